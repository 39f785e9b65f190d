"""A ladder's budget kept on a busy machine (issue 68): `fitgpt ladder --time-budget B` with BUSY CPU-bound processes
beside it, for each seed in turn, the whole command's wall time (from its launch to its exit) against its budget.

    python benchmarks/ladder_load.py --time-budget 2m --busy 2 --seeds 1337 7 --mechanics

Prints a Markdown table for benchmarks/RESULTS.md. ``--mechanics``: the ladder's design rules relaxed (any depths, any
tokens a parameter, no refusal of the law fitted), so that a budget too small to identify a law, refused by the
command itself, still runs its rungs, fit and picture: the time-keeping alone, measured on the whole command.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fitgpt.units import parse_duration

BUSY = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 86400: pass\n"
MECHANICS = ("import functools, sys\nfrom fitgpt.cli import main\nfrom fitgpt.scaling import design, ladder\n"
             "lax = design.Rules(min_tokens_per_param=0.0, saturated_tokens_per_param=0.0, min_range=1.0, identify=False)\n"
             "ladder.run_ladder = functools.partial(ladder.run_ladder, rules=lax)\nsys.exit(main())\n")  # its start: the process's


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-budget", default="2m")
    ap.add_argument("--busy", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1337, 7])
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--mechanics", action="store_true")
    args = ap.parse_args()
    budget = parse_duration(args.time_budget)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # through the finally: the busy processes end too
    print("| budget | busy processes | seed | wall (s) | wall / budget | points | law |\n|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(args.busy)]
        try:
            for seed in args.seeds:
                out = Path(tmp) / f"law{seed}.json"
                t0 = time.monotonic()
                command = [sys.executable, "-c", MECHANICS] if args.mechanics else ["fitgpt"]
                done = subprocess.run([*command, "ladder", "--time-budget", args.time_budget, "--seed", str(seed),
                                       "--depths", *map(str, args.depths), "--out", str(out), "--work-dir",
                                       str(Path(tmp) / f"w{seed}")], capture_output=True, text=True)
                wall = time.monotonic() - t0
                if done.returncode != 0:
                    print(f"| {args.time_budget} | {args.busy} | {seed} | {wall:.1f} | {wall / budget:.3f} | failed: "
                          f"{done.stderr.strip().splitlines()[-1][:200]} | |", flush=True)
                    continue
                summary = json.loads(done.stdout.strip().splitlines()[-1])
                c = summary["coefficients"]
                print(f"| {args.time_budget} | {args.busy} | {seed} | {wall:.1f} | {wall / budget:.3f} | {summary['points']} | "
                      f"E {c['E']:.3f}, alpha {c['alpha']:.3f}, beta {c['beta']:.3f} |", flush=True)
        finally:
            for p in busy:
                p.kill()


if __name__ == "__main__":
    main()
