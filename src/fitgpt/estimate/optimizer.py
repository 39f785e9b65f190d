"""What a profiled step does with the optimizer besides its segments: it readies it for a steady step (its state
made, the second pass of clipping in the backward), and counts what the segments do not show (the gradients held
at once, the running loss of accumulation, an offloaded optimizer's host step)."""

from __future__ import annotations

import torch

from fitgpt.config import OptimConfig
from fitgpt.estimate.timing import host_seconds_per_byte
from fitgpt.memory.flops import OpCost
from fitgpt.memory.timeline import param_bytes
from fitgpt.memory.tracker import round_up, storages


def host_step_time(optimizer, cost: OpCost | None) -> float:
    """An offloaded optimizer's host step, planned on the meta device (its ops cost nothing there): its bytes at the
    rate this machine's CPU steps AdamW."""
    if cost is None or getattr(getattr(optimizer, "host", None), "type", None) != "meta":
        return 0.0
    return optimizer.step_bytes() * host_seconds_per_byte()


def running_loss(grad_accum: int, round_to: int) -> int:
    """The fp32 loss the micro-batches before the last add up, held through each later one (``train_step``)."""
    return round_up(4, round_to) if grad_accum > 1 else 0


def create_state(optimizer) -> None:
    """An optimizer that steps inside the backward makes its state there, a parameter at a time, in the first step
    only: make it all now (``InBackward.create_state``; no byte depends on the values), so that every profiled step is
    a steady one. Others make theirs in the first profiled step's optimizer segment, as a first step does."""
    if getattr(optimizer, "steps_in_backward", False):
        optimizer.create_state()


def second_pass(optimizer, optim: OptimConfig) -> None:
    """Clipping with the step in the backward runs forward and backward twice (``fitgpt.step.train_step``); the
    second, which steps, is the one profiled (the first holds less: no step, each gradient dropped at once). Its
    gradients are scaled in place by the first pass's coefficient, a host float: no byte depends on its value."""
    if optimizer is not None and optim.clips_in_two_passes:
        optimizer.clip_by(1.0, 0.0)
        optimizer.norm_buffer(list(optimizer.optimizers))  # held between steps: one fp32 norm a parameter


def grads_at_once(model: torch.nn.Module, optim: OptimConfig, round_to: int) -> int:
    """The most gradient bytes a step holds at once, as the no-fit message counts them: every parameter's, or with the
    step in the backward about one parameter's (the largest)."""
    if not optim.in_backward:
        return param_bytes(model, round_to)
    return max(sum(round_up(st.nbytes(), round_to) for st in storages(p)) for p in model.parameters())
