"""`fitgpt fit --memory-budget 6GiB`: the largest batch, context and depth that fit, per policy."""

from __future__ import annotations

import json
from dataclasses import dataclass

import tyro

from fitgpt.memory.units import format_bytes
from fitgpt.plan.fit import POLICIES, fit
from fitgpt.plan.workload import BudgetConfig


@dataclass
class FitConfig(BudgetConfig):
    """How large a batch, context or model fits in a budget, without and with checkpointing."""


def run(args: list[str]) -> int:
    cfg = tyro.cli(FitConfig, args=args, prog="fitgpt fit")
    result = fit(cfg, cfg.budget)
    a, cur = result["answers"], result["current"]
    print(f"{result['workload']}; budget {format_bytes(result['budget'])}\n")
    print("| largest that fits | " + " | ".join(POLICIES) + " | block vs none | auto vs none |")
    print("|---|" + "---:|" * (len(POLICIES) + 2))
    for key, label in (("batch_size", f"batch (at context {cur['context']})"), ("context", f"context (at batch {cur['batch_size']})"),
                       ("n_blocks", f"blocks (at batch {cur['batch_size']} x {cur['context']})")):
        vals = [a[p][key] for p in POLICIES]
        ratios = [f"{v / vals[0]:.1f}x" if vals[0] else ("-" if not v else "fits only with it") for v in vals[1:]]
        print(f"| {label} | " + " | ".join(str(v) for v in vals) + " | " + " | ".join(ratios) + " |")
    print(f"\n({result['note']}; 0 means not even 1 fits)")
    print(json.dumps(result))
    return 0
