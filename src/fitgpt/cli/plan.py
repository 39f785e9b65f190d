"""`fitgpt plan --memory-budget 6GiB`: the cheapest checkpointing plan whose predicted peak fits."""

from __future__ import annotations

import json
from dataclasses import dataclass

import tyro

from fitgpt.memory.units import format_bytes, parse_bytes
from fitgpt.plan import Plan, predict, profile_model, solve
from fitgpt.plan.workload import WorkloadConfig


@dataclass
class PlanConfig(WorkloadConfig):
    """Profile the model once per option, then solve for the cheapest plan within the budget."""

    memory_budget: str = ""
    """Peak memory of a training step to fit in, e.g. 6GiB, 512MiB, 8GB (required)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.memory_budget:
            raise ValueError("--memory-budget is required, e.g. --memory-budget 6GiB")
        parse_bytes(self.memory_budget)


def run(args: list[str]) -> int:
    cfg = tyro.cli(PlanConfig, args=args, prog="fitgpt plan")
    budget = parse_bytes(cfg.memory_budget)
    tcfg = cfg.train_config()
    profile = profile_model(cfg.model_config, tcfg.batch_size, tcfg.model.context_length, cfg.torch_device(), tcfg.optim,
                            tcfg.grad_accum, cfg.dtype())
    print(f"{cfg.describe()}; budget {format_bytes(budget)}; profiled in {profile.seconds:.1f}s")
    print("\n| policy | predicted peak | FLOPs vs none | fits |\n|---|---:|---:|---|")
    n = profile.n_blocks
    for plan in (Plan.uniform(n, "none"), Plan.uniform(n, "selective"), Plan.uniform(n, "full"), Plan.uniform(n, "full", "chunked")):
        pred = predict(profile, plan)
        print(f"| {plan.spec()} | {format_bytes(pred.peak)} | {pred.flops_ratio:.3f}x | {'yes' if pred.peak <= budget else 'no'} |")
    plan, pred = solve(profile, budget)
    print(f"\nplan: {plan.spec()}")
    print(f"predicted peak {format_bytes(pred.peak)} of {format_bytes(budget)} (in the {pred.where}): "
          + ", ".join(f"{k} {format_bytes(v)}" for k, v in pred.breakdown().items()))
    print(f"predicted overhead: {pred.flops_ratio:.3f}x FLOPs")
    print(f"train with: fitgpt train --preset {tcfg.preset} --batch-size {tcfg.batch_size} "
          f"--model.context-length {tcfg.model.context_length} --checkpointing '{plan.spec()}'"
          f"   (or: --checkpointing auto --memory-budget {cfg.memory_budget})")
    print(json.dumps({"policy": plan.spec(), "budget": budget, "predicted_peak": pred.peak, "where": pred.where,
                      "breakdown": pred.breakdown(), "flops_ratio": pred.flops_ratio, "profile_seconds": profile.seconds}))
    return 0
