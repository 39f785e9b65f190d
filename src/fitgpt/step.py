"""One training step: the code that trains, that the profiler measures and that ``bench`` times.

Forward and backward over the micro-batches (gradients summed, each loss scaled by 1/n), then
``optimizer_update``: unscale (fp16), clip, skip a step whose loss or gradient norm is not finite,
step, free the gradients. The results stay on the device (the caller reads them when it logs).
The trainer adds only what it needs around it (distributed reduction through ``sync``/``reduce``);
the planner and ``bench`` call the same function, so the step they measure is the step that trains.
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
    """What a step leaves on the device: reading any of it on the host waits for the step to finish,
    so the trainer reads them together, at its log, evaluation and save points."""

    loss: torch.Tensor
    """0-d: the mean loss over the micro-batches (and over ranks, given ``reduce``)."""
    grad_norm: torch.Tensor
    """0-d: the total gradient norm before clipping (unscaled under fp16)."""
    applied: torch.Tensor
    """0-d bool: False when the loss or the gradient norm was not finite and the update was skipped."""


def grad_scaler(device: torch.device, dtype: torch.dtype | None) -> torch.amp.GradScaler:
    """The loss scaler fp16 needs (bf16 and fp32 get a disabled one, which passes everything through)."""
    return torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Fused AdamW/Adam take a ``found_inf`` tensor and skip the update (step counts included) on the device."""
    return bool(optimizer.defaults.get("fused"))


def optimizer_update(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor,
                     scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0,
                     check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Unscale, clip, and step unless the loss or the gradient norm is not finite; returns (grad norm,
    applied) as device tensors. Gradients stay.

    The decision is made on the device where the optimizer can skip there (fused AdamW: no host
    sync); otherwise it is read on the host (free on CPU). ``check=False`` always steps and reads
    nothing (the profiler, whose tensors may be fake and hold no values); the memory is the same.
    """
    if getattr(optimizer, "steps_in_backward", False):
        # Stepped already, a parameter at a time during the backward (``fitgpt.optim.in_backward``; clipped in two
        # passes by train_step): nothing left to decide. The config refuses fp16's scaler and skipping a bad step.
        norm = optimizer.take_grad_norm()
        return norm, torch.isfinite(loss) & torch.isfinite(norm)
    if scaler is not None:
        scaler.unscale_(optimizer)
    # The norm is computed even without clipping: it is logged, and a non-finite one means skipping the step.
    params = list(model.parameters())
    if hasattr(optimizer, "grad_holders"):  # offloaded: the host copies of the gradients are what steps
        params = optimizer.grad_holders(params)
    # The multi-tensor norm, as PyTorch picks for plain tensors, asked for explicitly so that the planner's fake
    # tensors (which PyTorch would send down the per-tensor path) run the very ops of a real step; PyTorch's own
    # choice for DTensors (FSDP) and for a planned host's meta tensors (which have no foreach kernels; the per-tensor
    # path holds the same 0-d norms).
    foreach = None if any(hasattr(p, "full_tensor") or p.device.type == "meta" for p in params) else True
    if hasattr(model, "clip_grad_norm_"):  # a pipeline: the norm over every stage's ranks (`fitgpt.parallel.pipeline`)
        norm = model.clip_grad_norm_(grad_clip if grad_clip > 0 else math.inf, foreach)
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf, foreach=foreach)
    if hasattr(norm, "full_tensor"):  # FSDP: a DTensor, the same total norm on every rank
        norm = norm.full_tensor()
    fp16 = scaler is not None and scaler.is_enabled()
    # Under fp16 the scaler skips overflowing steps itself (and lowers its scale): an inf norm is routine.
    ok = torch.isfinite(loss) if fp16 else torch.isfinite(loss) & torch.isfinite(norm)
    if not check:
        _step(optimizer, scaler)
    elif _skips_on_device(optimizer) and not fp16:
        optimizer.found_inf = (~ok).float()  # read by the fused kernel: 1 leaves parameters and state untouched
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    elif bool(ok):
        _step(optimizer, scaler)
    return norm.detach(), ok


def _step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def _clip_first(model: nn.Module, optimizer, batch: Batch, amp: AmpFactory, max_norm: float, check: bool) -> None:
    """The first of the two passes that clip exactly when the optimizer steps in the backward (one micro-batch: it
    cannot accumulate): forward and backward taking each gradient's norm and dropping it, with the RNG put back for
    the second pass to draw the same dropout; then the clipping coefficient the second pass applies, computed as
    ``clip_grad_norm_`` computes it (the parameters' norms stacked in the model's order). ``check=False`` (fake
    tensors): the coefficient is computed, not read, and the second pass scales by 1."""
    x, y = batch
    order = [p for p in model.parameters() if p.requires_grad]  # clip_grad_norm_'s order
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), optimizer.collecting_norms(order) as norms:
        with amp():
            loss = model(x, y)[1]
        (loss / 1).backward()
    total = optimizer.total_norm(norms)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if check:
        optimizer.clip_by(float(coefficient), float(total))
    else:
        optimizer.clip_by(1.0, 0.0)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], *,
               amp: AmpFactory = contextlib.nullcontext, scaler: torch.amp.GradScaler | None = None, grad_clip: float = 0.0,
               sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, check: bool = True,
               update: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> StepResult:
    """One optimizer step over ``batches`` (the micro-batches of gradient accumulation), with no host sync
    where the optimizer skips on the device (fused AdamW on CUDA).

    ``sync(is_last)``: the context each micro-batch runs in (DDP reduces gradients on the last one only).
    ``reduce``: the mean of the loss over ranks (a collective on the device), so that every rank decides alike.
    ``check=False``: never decide on values (fake tensors have none); the step is always taken.
    ``update``: called as ``optimizer_update`` is (the default), in its place: the planner's replay wraps it to cut the
    step's allocations into before, during and after the update.
    Ends with ``zero_grad(set_to_none=True)``: between steps no gradient memory is held. Under DDP with accumulation
    the gradients, views into DDP's buckets (held anyway), are zeroed in place instead: the micro-batches that skip
    the all-reduce then add into the buckets, rather than into a second whole set of gradients.
    """
    n = len(batches)
    total = None
    if getattr(optimizer, "steps_in_backward", False) and grad_clip > 0:
        _clip_first(model, optimizer, batches[0], amp, grad_clip, check)
    if hasattr(model, "train_batch"):  # a pipeline: its schedule runs every micro-batch's forward and backward
        ((x, y),) = batches
        with amp():
            total = model.train_batch(x, y)  # the batch's mean loss, on every rank of the pipeline
        batches = ()
    for i, (x, y) in enumerate(batches):
        with sync(i == n - 1) if sync else contextlib.nullcontext():
            with amp():
                loss = model(x, y)[1]  # only the loss: holding the (B, T, vocab) logits through backward costs memory
            (scaler.scale(loss / n) if scaler is not None else loss / n).backward()
        part = loss.detach().float() / n  # kept on the device: no .item() per micro-batch
        total = part if total is None else total + part
        del loss, part  # from the second micro-batch on, one running total is held, no more
    if reduce is not None and check:
        total = reduce(total)
    grad_norm, applied = (update or optimizer_update)(model, optimizer, total, scaler, grad_clip, check)
    optimizer.zero_grad(set_to_none=n == 1 or not getattr(model, "gradient_as_bucket_view", False))
    return StepResult(loss=total, grad_norm=grad_norm, applied=applied)
