"""Activation checkpointing: one mechanism, many policies, applied from outside the model."""

from fitgpt.checkpointing.apply import (
    CheckpointWrapper,
    ChunkedLossHead,
    applied_policy,
    apply_checkpointing,
    find_blocks,
    remove_checkpointing,
)
from fitgpt.checkpointing.policy import Policy, Region, parse_policy

__all__ = [
    "CheckpointWrapper",
    "ChunkedLossHead",
    "Policy",
    "Region",
    "applied_policy",
    "apply_checkpointing",
    "find_blocks",
    "parse_policy",
    "remove_checkpointing",
]
