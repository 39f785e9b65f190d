"""What a profile knows of one block, or of the head, under one checkpointing option: bytes kept and risen, FLOPs
recomputed, time. The types both the profile and what a card changes in them (`fitgpt.estimate.card`) use."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockOption:
    saved: int
    """Bytes the block's forward leaves alive for backward (its output included)."""
    fwd_rise: int
    """Peak above the level at the block's start, during its forward."""
    bwd_rise: int
    """Peak above the level at the start of its backward (recompute and gradient temporaries)."""
    recompute_flops: int
    """FLOPs its backward runs beyond the backward of the same block under ``none``."""
    transient: int = 0
    """Bytes its forward leaves alive only until the forward ends (autocast's weight copies when nothing
    saves them): held through the rest of the forward, freed before any backward."""
    time: float = 0.0
    """Seconds of its forward and backward (recompute included) by the profile's cost model."""


@dataclass(frozen=True)
class HeadOption:
    saved: int
    fwd_rise: int
    bwd_rise: int
    bwd_delta: int
    recompute_flops: int
    time: float = 0.0
