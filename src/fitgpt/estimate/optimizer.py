"""What a profiled step does with the optimizer besides its segments: it readies it for a steady step (its state
made, the second pass of clipping in the backward), and counts what the segments do not show (the gradients held
at once, the running loss of accumulation, an offloaded optimizer's host step); and the optimizer's fixed costs of a
model too deep to profile whole (``optimizer_costs``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fitgpt.config import OptimConfig
from fitgpt.estimate.timing import host_seconds_per_byte
from fitgpt.memory.flops import OpCost, OpFlops
from fitgpt.memory.timeline import grad_bytes, optimizer_state_bytes, optimizer_state_tensors, param_bytes
from fitgpt.memory.tracker import LiveMemory, round_up, storages
from fitgpt.optim import build_optimizer
from fitgpt.step import optimizer_update


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


def _first_step_steady(model: torch.nn.Module, optimizer) -> bool:
    """A step in the backward has its state made already (``create_state``), so that its first step is a steady one,
    in one process: a step of every parameter costs seconds on fake tensors at full depth (measured equal to the second
    for every optimizer, with and without clipping). Sharded (DTensor) parameters are not: under FSDP with a tied
    weight the first step holds bytes the second does not (7 on the tiny preset, 250 KB on the tests' model), so both
    are taken there, as others take them (the first makes the state, the second is measured)."""
    return (getattr(optimizer, "steps_in_backward", False)
            and not any(isinstance(p, DTensor) for p in model.parameters()))


def optimizer_costs(model: torch.nn.Module, optim: OptimConfig, target, grad_accum: int, persistent_grads: bool,
                    cost: OpCost | None) -> dict[str, int | float]:
    """Parameters, gradients, optimizer state and the optimizer step's workspace of ``model`` (the full model, on fake
    tensors, inside their mode): the step's optimizer segment (as ``profile_step`` runs it) with every gradient
    present, the first step making the state and the second, steady one measured (its FLOPs: the matmuls of Muon's
    iterations or of GaLore's projections); one step where the first is steady (``_first_step_steady``)."""
    round_to, accumulate = target.round_to, grad_accum > 1 or persistent_grads
    optimizer = build_optimizer(model, optim, torch.device(target.device))
    create_state(optimizer)
    rises, times = [], []
    for _ in range(1 if _first_step_steady(model, optimizer) else 2):
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                if p in getattr(optimizer, "twin", {}):  # offloaded: copied out, as its hook would in a backward
                    optimizer.copy_out(p)
        second_pass(optimizer, optim)
        loss = torch.zeros(())  # the step's loss, alive since its forward
        with LiveMemory(round_to) as live:
            live.watch(optimizer_state_tensors(optimizer))  # a state tensor the step replaces (a projection) is freed
            if getattr(optimizer, "steps_in_backward", False):
                optimizer.step()  # as the backward's hooks do (the blocks' segments hold its cost); what they leave
                live.rebase()  # (the norm's running total) is freed in this segment
            with OpFlops(cost) as clock:
                optimizer_update(model, optimizer, loss, grad_clip=optim.grad_clip, check=False)
                model.zero_grad(set_to_none=not accumulate)  # as profile_step ends a step
        rises.append(live.peak)
        times.append((clock.seconds, clock.total))
    params, opt = param_bytes(model, round_to), optimizer_state_bytes(optimizer, round_to)
    held = grad_bytes(model, round_to) if accumulate else 0
    grads = held if accumulate else grads_at_once(model, optim, round_to)
    return {"params": params, "optimizer": opt, "grads": grads, "baseline": params + opt + held + running_loss(grad_accum, round_to),
            "optimizer_rise": rises[-1], "optimizer_time": times[-1][0] + host_step_time(optimizer, cost),
            "optimizer_flops": times[-1][1],
            "host": optimizer.host_bytes() if hasattr(optimizer, "host_bytes") else 0}
