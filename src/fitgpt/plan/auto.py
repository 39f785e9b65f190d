"""--activation-checkpointing auto: the one entry point from a training config to a concrete plan."""

from __future__ import annotations

import logging

import torch

from fitgpt.config import TrainConfig
from fitgpt.memory.units import format_bytes, parse_bytes
from fitgpt.plan.profile import per_rank, profile_model
from fitgpt.plan.solver import solve
from fitgpt.plan.timing import calibrate

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, device: torch.device, dtype: torch.dtype | None, world: int = 1) -> dict:
    """--activation-checkpointing auto: profile this config for this device, then solve for the fastest plan (per rank),
    with the time model measured on this device."""
    budget = parse_bytes(cfg.memory_budget)
    ddp = world > 1 and cfg.parallel == "ddp"  # DDP keeps every gradient in its buckets
    # On CPU fake tensors give the real step's bytes exactly (tested), in a fraction of the time and memory;
    # on an accelerator the real step is measured, as the reference.
    cost = calibrate(cfg.model, cfg.batch_size, cfg.model.context_length, device, dtype, cfg.optim, seed=cfg.seed)
    profile = profile_model(cfg.model, cfg.batch_size, cfg.model.context_length, device, cfg.optim, cfg.grad_accum, dtype,
                            seed=cfg.seed, persistent_grads=ddp, fake=device.type == "cpu", cost=cost)
    profile = per_rank(profile, world, cfg.parallel)
    plan, pred = solve(profile, budget)
    log.info("auto: %s, predicted peak %s of budget %s (in the %s; %.3fx time, %.3fx FLOPs; profiled in %.1fs)", plan.spec(),
             format_bytes(pred.peak), format_bytes(budget), pred.where, pred.time_ratio, pred.flops_ratio, profile.seconds)
    if cfg.compile:
        log.info("auto: the plan was profiled in eager mode; compiled steps can differ (on CUDA the measured peak is logged)")
    return {"policy": plan.spec(), "budget": budget, "predicted_peak": pred.peak}
