"""Does the best learning rate found at the smallest rung stay best at a rung 8x larger? A sweep of AdamW's learning
rate at two depths of the ladder's family of 32 a block (`fitgpt ladder --aspect 32`: depth 1, 32 wide, 12K parameters
outside the embeddings; depth 2, 64 wide, 2 blocks, 98K: 8x), under the standard parametrisation and under muP +
CompleteP with depth 1 as the base shape (`--model.mup-base-width 32 --model.mup-base-depth 1`: at depth 1 the two are
the same model, step for step).

    python benchmarks/lr_transfer.py --data DIR --steps 400 --lrs 0.00075 0.0015 0.003 0.006 0.012 0.024 --out DIR

Each run is the tiny preset's recipe under WSD for --steps steps (warmup 30, cooldown a fifth), its loss the final
evaluation over 20 validation batches (the same windows for every run). The runs go learning rate by learning rate,
the sizes and parametrisations interleaved, so that the machine's drift spreads over all of them. Prints a table and
one JSON line; draws lr_transfer.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

SHAPES = {1: ["--model.n-blocks", "1", "--model.n-embed", "32", "--model.n-head", "1"],
          2: ["--model.n-blocks", "2", "--model.n-embed", "64", "--model.n-head", "2"]}
MUP = ["--model.mup-base-width", "32", "--model.mup-base-depth", "1"]


def _loss(run: Path) -> float:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in metrics if "val_loss" in m][-1]["val_loss"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lrs", type=float, nargs="+", default=[0.00075, 0.0015, 0.003, 0.006, 0.012, 0.024])
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    results = []
    done = {}
    if (out / "results.json").exists():  # a sweep stopped part way goes on from its last finished run
        results = json.loads((out / "results.json").read_text())
        done = {(r["param"], r["depth"], r["lr"]) for r in results}
    for lr in args.lrs:
        for param in ("sp", "mup"):
            for depth in SHAPES:
                if (param, depth, lr) in done:
                    continue
                run = out / f"{param}-d{depth}-lr{lr:g}-s{args.seed}"
                cmd = ["fitgpt", "train", "--preset", "tiny", *SHAPES[depth], *(MUP if param == "mup" else []),
                       "--data.dir", args.data, "--optim.lr", str(lr), "--optim.min-lr", str(lr / 10),
                       "--optim.schedule", "wsd", "--max-steps", str(args.steps), "--eval-interval", str(args.steps),
                       "--checkpoint-interval", str(args.steps), "--precision", "fp32", "--activation-checkpointing",
                       "none", "--seed", str(args.seed), "--out-dir", str(run), "--overwrite", "--no-progress",
                       "--no-tensorboard"]
                subprocess.run(cmd, check=True, capture_output=True)
                results.append({"param": param, "depth": depth, "lr": lr, "seed": args.seed, "val_loss": _loss(run)})
                out.mkdir(parents=True, exist_ok=True)
                (out / "results.json").write_text(json.dumps(results, indent=1))
                print(f"{param:4s} depth {depth} lr {lr:g}: {results[-1]['val_loss']:.4f}", flush=True)
    best = {}
    for param in ("sp", "mup"):
        for depth in SHAPES:
            mine = [r for r in results if r["param"] == param and r["depth"] == depth]
            best[f"{param}-d{depth}"] = min(mine, key=lambda r: r["val_loss"])["lr"]
    print(json.dumps({"best_lr": best, "results": results}))
    _draw(results, out / "lr_transfer.png")


def _draw(results: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no picture", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, param, title in zip(axes, ("sp", "mup"), ("standard parametrisation", "muP + CompleteP (base: depth 1)")):
        for depth in SHAPES:
            mine = sorted((r["lr"], r["val_loss"]) for r in results if r["param"] == param and r["depth"] == depth)
            ax.plot(*zip(*mine), marker="o", label=f"depth {depth}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (the base shape's)")
        ax.set_title(title)
        ax.legend()
    axes[0].set_ylabel("validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
