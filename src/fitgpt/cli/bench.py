"""`fitgpt bench`: compare checkpointing policies on one model and batch (memory, FLOPs, time)."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fitgpt.activation_checkpoint import parse_policy
from fitgpt.bench.report import format_table
from fitgpt.bench.run import DEFAULT_POLICIES, auto_target, run_bench
from fitgpt.cli.workload import WorkloadConfig, parse_workload
from fitgpt.errors import UserError
from fitgpt.estimate.workload import Workload, workload_for
from fitgpt.utils import writable_dir


@dataclass
class BenchConfig(WorkloadConfig):
    """Measure checkpointing policies on one model and batch: memory, FLOPs, time."""

    device: Optional[str] = "auto"
    """Where to measure: auto, cpu, cuda, cuda:1, mps (bench always runs real steps)."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies to compare (the first is the baseline); auto:50% frees half of none's activations, auto:6GiB plans for a budget."""
    repeats: int = 25
    """Timed steps per policy (medians are reported)."""
    warmup: int = 2
    """Untimed steps per policy before timing."""
    out_dir: str = "bench"
    """Where bench.json and bench.png go."""
    seed: int = 0
    activation_checkpointing: Optional[str] = None
    """As for fitgpt train: measure this policy beside none (short for --policies none POLICY)."""

    def __post_init__(self) -> None:
        if self.target or self.gpu:  # before the shared checks, whose message (--device or --gpu) does not fit bench
            raise UserError("fitgpt bench measures real steps on this machine (--device); to plan for another "
                             "device use fitgpt plan --target/--gpu")
        super().__post_init__()
        if self.repeats < 1 or self.warmup < 0:
            raise UserError("--repeats must be at least 1 and --warmup at least 0")
        if self.world_size != 1:
            raise UserError("fitgpt bench measures one process; for per-rank memory under DDP or FSDP use "
                             "fitgpt plan --world-size N --parallel ddp|fsdp")
        if self.activation_checkpointing is not None:
            if self.policies != DEFAULT_POLICIES:
                raise UserError("--activation-checkpointing POLICY is --policies none POLICY: give one of the two")
            self.policies = ("none", self.activation_checkpointing)
        if not self.policies:
            raise UserError("--policies: give at least one policy")
        for spec in self.policies:
            if spec.startswith("auto"):
                auto_target(spec)
            else:
                parse_policy(spec)

    @functools.cached_property
    def workload(self) -> Workload:
        """Real steps on --device; the planner's prediction beside them is profiled as `plan` and `auto` profile
        (on fake tensors on a CPU, with the time model calibrated on this device). --seed seeds the model."""
        cfg = dataclasses.replace(self.train_config(), seed=self.seed)
        return workload_for(cfg, device=self.measured_device(), source=self._source)


def run(args: list[str]) -> int:
    cfg = parse_workload(BenchConfig, args, "fitgpt bench")
    writable_dir(Path(cfg.out_dir), "--out-dir")  # before anything is measured (the workload calibrates its time model)
    result = run_bench(cfg.workload, cfg.policies, cfg.out_dir, warmup=cfg.warmup, repeats=cfg.repeats)
    print(format_table(result))
    for spec, why in result["setup"]["skipped"].items():
        print(f"\n{spec}: not run: {why}")
    print(f"\nwrote {cfg.out_dir}/bench.json" + (f" and {result['png']}" if result.get("png") else ""))
    print(json.dumps(result))
    return 0
