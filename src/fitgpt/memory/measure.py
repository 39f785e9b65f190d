"""Measurements of one training micro-batch: activation bytes, saved bytes, peak, FLOPs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fitgpt.memory.flops import count_flops
from fitgpt.memory.tracker import LiveMemory, SavedTensors


@dataclass
class StepMemory:
    activation_bytes: int
    """Bytes alive after the forward pass that were not alive before it: what backward will need."""
    saved_bytes: int
    """Unique storages that autograd saved outside checkpoint regions (parameters excluded)."""
    peak_bytes: int
    """Peak of bytes created during forward + backward (on top of parameters and existing state)."""


def _step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> None:
    _, loss = model(idx, targets)
    loss.backward()


def measure_step_memory(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> StepMemory:
    """Run forward and backward once and count what they hold; gradients are left on the model."""
    model.zero_grad(set_to_none=True)
    with LiveMemory() as live:
        with SavedTensors(model) as saved:
            _, loss = model(idx, targets)
        activations = live.current
        loss.backward()
        peak = live.peak
    del loss
    return StepMemory(activation_bytes=activations, saved_bytes=saved.bytes, peak_bytes=peak)


def measure_step_flops(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """FLOPs of one forward + backward; gradients are left on the model."""
    model.zero_grad(set_to_none=True)
    return count_flops(_step, model, idx, targets)
