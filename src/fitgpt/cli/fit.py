"""`fitgpt fit --memory-budget 6GiB`: the largest batch, context and depth that fit, per policy."""

from __future__ import annotations

import json
from dataclasses import dataclass

from fitgpt.cli.workload import BudgetConfig, parse_workload
from fitgpt.errors import UserError
from fitgpt.plan.fastest import fastest, format_choices
from fitgpt.plan.largest import largest
from fitgpt.units import format_bytes


@dataclass
class FitConfig(BudgetConfig):
    """How large a batch, context or model fits in a budget, without and with checkpointing; and the fastest
    configuration (micro-batch x accumulation, precision, DDP/FSDP, checkpointing plan) that fits."""

    top: int = 5
    """How many of the fastest configurations to show."""
    activation_checkpointing: str = "auto"
    """As for fitgpt train: auto plans each configuration; a policy (block, selective, torchtitan, ...) is kept as
    given, in the fastest configurations and as a column of the largest sizes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top < 1:
            raise UserError("--top must be at least 1")
        if self.activation_checkpointing != "auto":
            self.check_policy(self.activation_checkpointing)


def run(args: list[str]) -> int:
    cfg = parse_workload(FitConfig, args, "fitgpt fit")
    result = largest(cfg.workload, cfg.budget, given=cfg.activation_checkpointing)
    a, cur, policies = result["answers"], result["current"], result["policies"]
    print(f"{result['workload']}; budget {format_bytes(result['budget'])}\n")
    print("| largest that fits | " + " | ".join(policies) + " | " + " | ".join(f"{p} vs none" for p in policies[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(policies) - 1))
    for key, label in (("batch_size", f"batch (at context {cur['context']})"), ("context", f"context (at batch {cur['batch_size']})"),
                       ("n_blocks", f"blocks (at batch {cur['batch_size']} x {cur['context']})")):
        vals = [a[p][key] for p in policies]
        ratios = [f"{v / vals[0]:.1f}x" if vals[0] else ("-" if not v else "fits only with it") for v in vals[1:]]
        print(f"| {label} | " + " | ".join(str(v) for v in vals) + " | " + " | ".join(ratios) + " |")
    print(f"\n({result['note']}; 0 means not even 1 fits)")
    best = fastest(cfg.workload, cfg.budget, top=cfg.top, policy=cfg.activation_checkpointing)
    print("\nThe fastest configurations for the same tokens a step:\n")
    print(format_choices(best, cfg.workload))
    result["fastest"] = [{"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "precision": c.precision,
                          "parallel": c.layout.name, "policy": c.policy, "predicted_peak": c.peak,
                          "step_seconds": c.step_seconds, "link_seconds": c.link_seconds, "tokens_per_s": c.tokens_per_s}
                         for c in best["choices"]]
    print(json.dumps(result))
    return 0
