"""`fitgpt bench`: compare checkpointing policies on one model and batch (memory, FLOPs, time)."""

from __future__ import annotations

import json

import tyro

from fitgpt.plan.bench import BenchConfig, format_table, run_bench


def run(args: list[str]) -> int:
    cfg = tyro.cli(BenchConfig, args=args, prog="fitgpt bench")
    result = run_bench(cfg)
    print(format_table(result))
    for spec, why in result["setup"]["skipped"].items():
        print(f"\n{spec}: not run: {why}")
    print(f"\nwrote {cfg.out_dir}/bench.json" + (f" and {result['png']}" if result.get("png") else ""))
    print(json.dumps(result))
    return 0
