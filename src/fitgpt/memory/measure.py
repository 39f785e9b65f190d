"""Measurements of one training micro-batch: activation bytes (total and per block), saved bytes, FLOPs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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
    block_bytes: list[int] = field(default_factory=list)
    """Of activation_bytes, what each position of the block list added during its forward call."""


def default_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A closure computing the loss of fitgpt-style models (logits, loss) or HF models (``.loss``)."""

    def loss_fn() -> torch.Tensor:
        if hasattr(model, "config") and not hasattr(model.config, "n_blocks"):  # a Hugging Face model
            out = model(idx, labels=targets, use_cache=False)
        else:
            out = model(idx, targets)
        return out[1] if isinstance(out, tuple) else out.loss

    return loss_fn


def measure_step_memory(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, blocks: nn.ModuleList | None = None,
                        loss_fn: Callable[[], torch.Tensor] | None = None) -> StepMemory:
    """Run forward and backward once and count what they hold; gradients are left on the model.

    ``blocks``: a block list whose positions get a per-position share of the activation bytes.
    """
    loss_fn = loss_fn or default_loss(model, idx, targets)
    model.zero_grad(set_to_none=True)
    block_bytes: list[int] = []
    handles = []
    with LiveMemory() as live:
        if blocks is not None:
            before: dict[int, int] = {}
            block_bytes = [0] * len(blocks)
            for i, mod in enumerate(blocks):
                handles.append(mod.register_forward_pre_hook(lambda m, a, i=i: before.__setitem__(i, live.current)))
                handles.append(mod.register_forward_hook(
                    lambda m, a, o, i=i: block_bytes.__setitem__(i, block_bytes[i] + live.current - before[i])))
        try:
            with SavedTensors(model) as saved:
                loss = loss_fn()
        finally:
            for h in handles:
                h.remove()
        activations = live.current
        loss.backward()
        peak = live.peak
    del loss
    return StepMemory(activation_bytes=activations, saved_bytes=saved.bytes, peak_bytes=peak, block_bytes=block_bytes)


def measure_step_flops(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor,
                       loss_fn: Callable[[], torch.Tensor] | None = None) -> int:
    """FLOPs of one forward + backward (matmuls and attention); gradients are left on the model."""
    loss_fn = loss_fn or default_loss(model, idx, targets)
    model.zero_grad(set_to_none=True)
    return count_flops(lambda: loss_fn().backward())
