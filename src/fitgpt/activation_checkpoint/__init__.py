"""Activation checkpointing: one mechanism, many policies, applied from outside the model."""

from fitgpt.activation_checkpoint.apply import (
    ActivationCheckpointWrapper,
    ChunkedLossHead,
    applied_policy,
    apply_activation_checkpointing,
    find_blocks,
    remove_activation_checkpointing,
)
from fitgpt.activation_checkpoint.policy import Policy, Region, parse_policy

__all__ = [
    "ActivationCheckpointWrapper",
    "ChunkedLossHead",
    "Policy",
    "Region",
    "applied_policy",
    "apply_activation_checkpointing",
    "find_blocks",
    "parse_policy",
    "remove_activation_checkpointing",
]
