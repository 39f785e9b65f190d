"""One training step: the code that trains, that the profiler measures and that ``bench`` times.

Forward and backward over the micro-batches (gradients summed, each loss scaled by 1/n), then
``optimizer_update``: unscale (fp16), clip, skip a step whose loss or gradient norm is not finite,
step, free the gradients. The trainer adds only what it needs around it (distributed reduction
through ``sync``/``reduce``); the planner and ``bench`` call the same function, so the step they
measure is the step that trains.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

Batch = tuple[torch.Tensor, torch.Tensor]  # (idx, targets), both (B, T) int64
AmpFactory = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepResult:
    loss: float
    """Mean loss over the micro-batches (and over ranks, given ``reduce``)."""
    grad_norm: float
    """Total gradient norm before clipping (of the scaled gradients' unscaled values under fp16)."""
    applied: bool
    """False when the loss or the gradient norm was not finite and the optimizer step was skipped."""


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """The loss scaler fp16 needs (bf16 and fp32 get a disabled one, which passes everything through)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def optimizer_update(model: nn.Module, optimizer: torch.optim.Optimizer, loss: float,
                     scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0, check: bool = True) -> tuple[float, bool]:
    """Unscale, clip, step unless something is not finite; returns (grad norm, applied). Gradients stay.

    ``check=False`` steps without reading the norm on the host (the profiler, whose tensors may be
    fake and hold no values); the device-side work, and so the memory, is the same.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    # The norm is computed even without clipping: it is logged, and a non-finite one means skipping the step.
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    grad_norm = float(norm) if check else math.nan
    fp16 = scaler is not None and scaler.is_enabled()
    # Under fp16 the scaler skips overflowing steps itself (and lowers its scale): an inf norm is routine.
    applied = not check or (math.isfinite(loss) and (fp16 or math.isfinite(grad_norm)))
    if applied:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    return grad_norm, applied


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], *,
               amp: AmpFactory = contextlib.nullcontext, scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0,
               sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
               reduce: Callable[[float], float] | None = None, check: bool = True) -> StepResult:
    """One optimizer step over ``batches`` (the micro-batches of gradient accumulation).

    ``sync(is_last)``: the context each micro-batch runs in (DDP reduces gradients on the last one only).
    ``reduce``: the mean of the loss over ranks, so that every rank decides alike whether to step.
    ``check=False``: never read a value on the host (fake tensors have none); the step is always taken.
    Ends with ``zero_grad(set_to_none=True)``: between steps no gradient memory is held.
    """
    n = len(batches)
    total = None
    for i, (x, y) in enumerate(batches):
        with sync(i == n - 1) if sync else contextlib.nullcontext():
            with amp():
                loss = model(x, y)[1]  # only the loss: holding the (B, T, vocab) logits through backward costs memory
            (scaler.scale(loss / n) if scaler is not None else loss / n).backward()
        part = loss.detach().float() / n
        total = part if total is None else total + part
        del loss
    value = float(total) if check else math.nan  # one host sync per step, not one per micro-batch
    if reduce is not None and check:
        value = reduce(value)
    grad_norm, applied = optimizer_update(model, optimizer, value, scaler, grad_clip, check)
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss=value, grad_norm=grad_norm, applied=applied)
