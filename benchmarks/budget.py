"""The model a budget buys, measured: fit --time-budget's rows against runs of them trained for that time.

    python benchmarks/budget.py run  --law law.json --time-budget 4m --depths 1 2 3 4 --seeds 1337 7 --out DIR
    python benchmarks/budget.py report --fit DIR/fit.json --runs DIR/runs --out benchmarks/budget

`run` asks fit for its rows (its last JSON line, kept as fit.json), then trains each listed depth's printed command
for each seed, interleaved (a depth's seeds apart), each into DIR/runs/dD-sS. `report` prints, per depth and seed:
the predicted and measured tokens/s (the run's steps x tokens a step over its seconds of steps; and the median of its
logged intervals), tokens, val loss predicted and measured, the run's wall time against its budget; and draws the U
of measured loss against parameters beside the law's (u.png). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _run(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fit = subprocess.run(["fitgpt", "fit", "--law", args.law, "--time-budget", args.time_budget], capture_output=True,
                         text=True, check=True).stdout
    (out / "fit.json").write_text(fit.strip().splitlines()[-1])
    rows = {r["depth"]: r for r in json.loads(fit.strip().splitlines()[-1])["rows"]}
    walls = {}
    for seed in args.seeds:
        for depth in args.depths:
            run = out / "runs" / f"d{depth}-s{seed}"
            command = shlex.split(rows[depth]["command"]) + ["--seed", str(seed), "--out-dir", str(run), "--no-progress",
                                                             "--no-tensorboard"]
            t0 = time.perf_counter()
            subprocess.run(command, capture_output=True, check=True)
            walls[run.name] = time.perf_counter() - t0
    (out / "walls.json").write_text(json.dumps(walls))


def _measured(run: Path) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    config = json.loads((run / "config.json").read_text())
    last = json.loads(sorted((run / "checkpoints").glob("step_*/meta.json"))[-1].read_text())
    steps = last["step"]
    per_step = config["batch_size"] * config["grad_accum"] * config["model"]["context_length"]
    logged = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m][1:]  # the first interval holds the start-up
    return {"steps": steps, "tokens": steps * per_step, "val_loss": [m for m in metrics if "val_loss" in m][-1]["val_loss"],
            "tokens_per_s_logged": statistics.median(logged), "time_spent": last["time_spent"],
            "budget": config["time_budget"], "depth": config["model"]["n_blocks"], "seed": config["seed"]}


def _report(args) -> None:
    fit = json.loads(Path(args.fit).read_text())
    rows = {r["depth"]: r for r in fit["rows"]}
    walls = json.loads((Path(args.runs).parent / "walls.json").read_text()) if (Path(args.runs).parent / "walls.json").exists() else {}
    results = [_measured(run) | {"wall": walls.get(run.name)} for run in sorted(Path(args.runs).iterdir())]
    print("| depth | seed | params | tokens/s predicted | measured (logged median) | tokens predicted | measured | "
          "val loss predicted (interval) | measured | time spent / budget |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    for m in results:
        r = rows[m["depth"]]
        print(f"| {m['depth']}{' (pick)' if fit['pick'] == list(rows).index(m['depth']) else ''} | {m['seed']} | "
              f"{r['params']:,} | {r['tokens_per_s']:,.0f} | {m['tokens_per_s_logged']:,.0f} "
              f"({m['tokens_per_s_logged'] / r['tokens_per_s'] - 1:+.1%}) | {r['tokens']:,} | {m['tokens']:,} | "
              f"{r['predicted_loss']:.3f} ({r['loss_low']:.3f} to {r['loss_high']:.3f}) | {m['val_loss']:.3f} "
              f"({r['predicted_loss'] / m['val_loss'] - 1:+.1%}) | {m['time_spent']:.1f}s"
              + (f" (wall {m['wall']:.1f}s)" if m.get("wall") else "") + f" / {m['budget']} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _draw(fit, results, out / "u.png")
    print(json.dumps({"pick": fit["pick"], "rows": fit["rows"], "runs": results}))


def _draw(fit: dict, results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = fit["rows"]
    ax.errorbar([r["params"] for r in rows], [r["predicted_loss"] for r in rows],
                yerr=[[r["predicted_loss"] - r["loss_low"] for r in rows], [r["loss_high"] - r["predicted_loss"] for r in rows]],
                fmt="o--", capsize=3, label="predicted by the law (bootstrap 5-95%)")
    by_params = {r["depth"]: r["params"] for r in rows}
    ax.scatter([by_params[m["depth"]] for m in results], [m["val_loss"] for m in results], marker="x", s=70, color="red",
               zorder=3, label="measured: trained for the budget (each seed)")
    pick = rows[fit["pick"]]
    ax.axvline(pick["params"], color="grey", lw=0.8, ls=":", label=f"the pick: depth {pick['depth']}")
    ax.set(xscale="log", xlabel="parameters (non-embedding)", ylabel="val loss",
           title=f"The same {fit['time_budget_seconds'] / 60:.0f} minutes of this CPU, each model size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--law", required=True)
    r.add_argument("--time-budget", default="4m")
    r.add_argument("--depths", type=int, nargs="+", required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[1337])
    r.add_argument("--out", required=True)
    q = sub.add_parser("report")
    q.add_argument("--fit", required=True)
    q.add_argument("--runs", required=True)
    q.add_argument("--out", default="benchmarks/budget")
    args = p.parse_args(argv)
    _run(args) if args.mode == "run" else _report(args)


if __name__ == "__main__":
    main(sys.argv[1:])
