"""--activation-checkpointing auto: the one entry point from a training config to a concrete plan."""

from __future__ import annotations

import logging

import torch

from fitgpt.config import TrainConfig
from fitgpt.estimate.profile import BLOCK_OPTIONS
from fitgpt.estimate.workload import workload_for
from fitgpt.plan.solver import PlanError, solve
from fitgpt.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


def plan_for(cfg: TrainConfig, device: torch.device, world: int = 1) -> dict:
    """--activation-checkpointing auto: the fastest plan (per rank) for this config on this device, with the time
    model measured on it (profiled on fake tensors on a CPU, measured on an accelerator: `workload_for`)."""
    budget = parse_bytes(cfg.memory_budget)
    if cfg.pipeline_parallel > 1:
        return _pipeline_plan(cfg, device, world, budget)
    profile = workload_for(cfg, device=device, world_size=world).profile()
    plan, pred = solve(profile, budget)
    log.info("auto: %s, predicted peak %s of budget %s (in the %s; %.3fx time, %.3fx FLOPs; profiled in %.1fs)", plan.spec(),
             format_bytes(pred.peak), format_bytes(budget), pred.where, pred.time_ratio, pred.flops_ratio, profile.seconds)
    if cfg.compile:
        log.info("auto: the plan was profiled in eager mode; compiled steps can differ (on CUDA the measured peak is logged)")
    return {"policy": plan.spec(), "budget": budget, "predicted_peak": pred.peak}


def _pipeline_plan(cfg: TrainConfig, device: torch.device, world: int, budget: int) -> dict:
    """Under --pipeline-parallel: the least recomputing of none, pointwise, selective and block whose every rank fits
    (each rank's step planned on fake ranks, `fitgpt.estimate.pipeline`), as `fitgpt plan` picks it."""
    w = workload_for(cfg, device=device, world_size=world)
    peaks = {}
    for policy in BLOCK_OPTIONS:
        stages = w.stages(policy)
        peaks[policy] = max(s.peak for s in stages)
        if peaks[policy] <= budget:
            log.info("auto: %s, every pipeline rank within %s (the largest %s; planned in %.1fs)", policy,
                     format_bytes(budget), format_bytes(peaks[policy]), sum(s.seconds for s in stages))
            return {"policy": policy, "budget": budget, "predicted_peak": peaks[policy]}
    raise PlanError(f"no checkpointing fits every pipeline rank in --memory-budget {cfg.memory_budget}: block's largest rank "
                    f"needs {format_bytes(peaks['block'])}; use more stages (--pipeline-parallel), smaller micro-batches "
                    "(more --pipeline-microbatches), or shard each stage (--parallel fsdp over more ranks)")
