"""The optimizer's memory settings on this CPU: bytes per parameter at the peak (planned vs measured) and the tiny
preset's first run under each (val loss vs AdamW fp32's, the same steps).

    python benchmarks/optimizers.py bytes     # a few minutes
    python benchmarks/optimizers.py quality   # the README's first run once per setting (about 1 min each)
    python benchmarks/optimizers.py quality --size larger --threads 1   # 5.3M parameters, 1,000 steps (15-20 min each)
    python benchmarks/optimizers.py quality --size gpu       # 26M parameters, 2,000 steps (minutes each on a card)
    python benchmarks/optimizers.py curves    # one picture of every setting's loss curve, from quality's runs

Each prints a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig, load_config
from fitgpt.estimate.profile import profile_model
from fitgpt.memory.timeline import measure_train_step
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer
from fitgpt.plan import Plan, predict
from fitgpt.train.trainer import train

SETTINGS = {  # clipping at the preset's 1.0 unless said: with the step in the backward, in two passes
    "AdamW fp32": {},
    "in-backward": {"in_backward": True},
    "bf16 moments": {"state_dtype": "bf16"},
    "bf16 moments + in-backward": {"state_dtype": "bf16", "in_backward": True},
    "8-bit AdamW": {"name": "adamw8bit"},
    "8-bit AdamW + in-backward": {"name": "adamw8bit", "in_backward": True},
    "4-bit AdamW + in-backward": {"name": "adamw4bit", "in_backward": True},
    "Adafactor": {"name": "adafactor"},
    "Adafactor + in-backward": {"name": "adafactor", "in_backward": True},
    "Muon": {"name": "muon"},
    "Muon + in-backward": {"name": "muon", "in_backward": True},
    # Adafactor's lr caps its relative step (a fraction of each parameter's RMS), not an absolute one as AdamW's.
    "Adafactor, lr 1e-2": {"name": "adafactor", "lr": 1e-2, "min_lr": 1e-3},
    "Adafactor, lr 3e-2": {"name": "adafactor", "lr": 3e-2, "min_lr": 3e-3},
    # GaLore and APOLLO at a quarter of the width (the tiny preset's 128: rank 32), as GaLore's 7B recipe (1024 of 4096);
    # APOLLO-Mini at its rank 1. The authors' recipes run lr 1e-2.
    "GaLore AdamW": {"name": "galore-adamw", "rank": 32},
    "GaLore AdamW + in-backward": {"name": "galore-adamw", "rank": 32, "in_backward": True},
    "GaLore AdamW, lr 1e-2": {"name": "galore-adamw", "rank": 32, "lr": 1e-2, "min_lr": 1e-3},
    "GaLore Adafactor": {"name": "galore-adafactor", "rank": 32},
    "APOLLO": {"name": "apollo", "rank": 32},
    "APOLLO, lr 1e-2": {"name": "apollo", "rank": 32, "lr": 1e-2, "min_lr": 1e-3},
    "APOLLO-Mini": {"name": "apollo-mini"},
    "APOLLO-Mini + in-backward": {"name": "apollo-mini", "in_backward": True},
    "APOLLO-Mini, lr 1e-2": {"name": "apollo-mini", "lr": 1e-2, "min_lr": 1e-3},
    # The host's CPU steps torch's fused AdamW (no temporaries): on this CPU, where host and card are one memory, the
    # tracker's peak is then still the card's alone.
    "AdamW on the host": {"offload": True, "impl": "fused"},
    "AdamW on the host + in-backward": {"offload": True, "in_backward": True, "impl": "fused"},
    "AdamW fp32, no clipping": {"grad_clip": 0.0},
    "in-backward, no clipping (one pass)": {"in_backward": True, "grad_clip": 0.0},
}


def _chosen(only: list[str] | None) -> dict[str, dict]:
    unknown = set(only or ()) - set(SETTINGS)
    if unknown:
        raise SystemExit(f"--only: no setting {sorted(unknown)}; choose from {list(SETTINGS)}")
    return {k: SETTINGS[k] for k in only} if only else dict(SETTINGS)  # in the order given


def bytes_per_param(settings: dict[str, dict]) -> None:
    """A model whose parameters dominate its step (25M parameters in 8 blocks of width 512, batch 1 x 16)."""
    cfg = ModelConfig(vocab_size=512, context_length=16, n_embed=512, n_head=8, n_blocks=8, dropout=0.0)
    idx = torch.randint(0, cfg.vocab_size, (1, 17), generator=torch.Generator().manual_seed(1))
    batches = [(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())]
    print("| setting | held (params + grads + state) / param | peak / param, predicted | measured | equal | host / param | "
          "plan s |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, kw in settings.items():
        optim = OptimConfig(**kw)
        t0 = time.perf_counter()
        profile = profile_model(cfg, 1, 16, "cpu", optim, fake=True)
        pred = predict(profile, Plan.uniform(cfg.n_blocks, "none"))
        seconds = time.perf_counter() - t0
        torch.manual_seed(0)
        model = Transformer(cfg)
        apply_activation_checkpointing(model, "none")
        # GaLore and APOLLO: the plan is the step that refreshes the projection (the larger); measure that one.
        real = dataclasses.replace(optim, update_proj_gap=1) if optim.projects else optim
        opt = build_optimizer(model, real, torch.device("cpu"))
        step_kw = {"grad_clip": optim.grad_clip}
        measure_train_step(model, opt, batches, **step_kw)  # the optimizer state exists from here on
        measured = measure_train_step(model, opt, batches, **step_kw).peak
        n = sum(p.numel() for p in model.parameters())
        held = (pred.params + pred.grads + pred.optimizer) / n
        print(f"| {name} | {held:.2f} | {pred.peak / n:.2f} | {measured / n:.2f} | "
              f"{'=' if measured == pred.peak else f'{measured - pred.peak:+d} B'} | {profile.host / n:.2f} | "
              f"{seconds:.1f} |", flush=True)


def _run_dir(out: str, name: str) -> Path:
    return Path(out) / name.replace(" ", "_").replace(",", "")


# The picture's panels: each setting's family.
PANELS = {"AdamW and its low-memory forms": ("AdamW", "in-backward", "bf16", "8-bit", "4-bit"),
          "Adafactor and Muon": ("Adafactor", "Muon"), "GaLore and APOLLO": ("GaLore", "APOLLO")}


def curves(out: str, settings: dict[str, dict], png: str, size: str = "readme") -> None:
    """One picture of every setting's training loss on the README's first run (the runs ``quality`` left in ``out``),
    AdamW fp32's curve in each panel, its validation losses as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.5), sharey=True)
    for ax, (title, prefixes) in zip(axes, PANELS.items()):
        for name in settings:
            runs = _run_dir(out, name) / "metrics.jsonl"
            if not runs.exists() or not (name == "AdamW fp32" or name.startswith(prefixes)):
                continue
            rows = [json.loads(line) for line in runs.read_text().splitlines()]
            train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
            line, = ax.plot(*zip(*train), label=name, lw=2.5 if name == "AdamW fp32" else 1.2,
                            color="black" if name == "AdamW fp32" else None)
            ax.plot(*zip(*[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]), "o", color=line.get_color())
        ax.set(title=title, xlabel="step", ylim=(3.0 if size == "readme" else 2.5, 7.5))
        ax.legend(fontsize=7)
    axes[0].set_ylabel("train loss (lines), val loss (points)")
    fig.suptitle(f"{SIZES[size][1]}, one seed) under each optimizer setting")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"picture: {png}")


# The runs, by --size: each setting's overrides of the tiny preset, and how the picture names it. Low-rank settings
# keep a quarter of the width (rank 32 of the preset's 128, doubled at 256 wide, ...).
# larger: 4x the tiny preset's parameters (256 wide, 6 blocks: 5.3M) and 3.3x its tokens (1,000 steps of 16 x 128),
# what this CPU finishes in 15-20 min a setting on one core.
# gpu: the larger run, 26M parameters (512 wide, 8 blocks, context 256) for 2,000 steps (8.2M tokens, two
# passes over the built-in corpus): about an hour a setting on this CPU, minutes on a card (gpu_check.sh step 7c).
SIZES = {
    "readme": ({}, "The README's first run (tiny preset, 300 steps"),
    "larger": ({"model": {"n_embed": 256, "n_blocks": 6}, "max_steps": 1000, "eval_interval": 250,
                "checkpoint_interval": 1000}, "5.3M parameters (1,000 steps"),
    "gpu": ({"model": {"n_embed": 512, "n_head": 8, "n_blocks": 8, "context_length": 256}, "max_steps": 2000,
             "eval_interval": 250, "checkpoint_interval": 2000}, "26M parameters (2,000 steps"),
}


def _overrides(kw: dict, size: str) -> dict:
    run, _ = SIZES[size]
    if not run:
        return {"optim": kw}
    scale = run["model"]["n_embed"] // 128
    optim = dict(kw, warmup_steps=run["max_steps"] // 10, **({"rank": kw["rank"] * scale} if "rank" in kw else {}))
    return {**run, "optim": optim}


def quality(out: str, settings: dict[str, dict], size: str = "readme") -> None:
    """The README's first run (tiny preset, 300 steps), or a larger one (``SIZES``), under each setting, same seed
    and data."""
    print("| setting | train loss | val loss | vs AdamW fp32 | vs AdamW fp32 with the same clipping | seconds |")
    print("|---|---:|---:|---:|---:|---:|")
    base: dict[float, float] = {}  # grad_clip -> AdamW fp32's val loss
    for name, kw in settings.items():
        if kw.get("offload"):  # the trainer offloads from a CUDA card only; its weights are AdamW's bit for bit (tested)
            continue
        cfg = load_config("tiny", overrides={**_overrides(kw, size), "out_dir": str(_run_dir(out, name)),
                                             "overwrite": True, "progress": False, "tensorboard": False})
        s = train(cfg)
        base.setdefault(cfg.optim.grad_clip, s["val_loss"])
        vs = [100 * (s["val_loss"] / b - 1) for b in (base[1.0], base[cfg.optim.grad_clip])]
        print(f"| {name} | {s['train_loss']:.4f} | {s['val_loss']:.4f} | {vs[0]:+.2f}% | {vs[1]:+.2f}% | "
              f"{s['seconds']:.0f} |", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["bytes", "quality", "curves"])
    ap.add_argument("--out", default="/tmp/fitgpt-optimizers")
    ap.add_argument("--png", default="docs/optimizer-loss.png", help="curves: the picture (quality's runs, from --out)")
    ap.add_argument("--only", nargs="+", help="these settings alone (AdamW fp32 first, for quality: the reference)")
    ap.add_argument("--size", choices=list(SIZES), default="readme",
                    help="quality and curves: the README's first run, 5.3M parameters for 1,000 steps, or 26M for 2,000")
    ap.add_argument("--threads", type=int, help="torch's threads (one core each, beside other work)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = _chosen(args.only)
    if args.what == "bytes":
        bytes_per_param(chosen)
    elif args.what == "quality":
        quality(args.out, chosen, args.size)
    else:
        curves(args.out, chosen, args.png, args.size)
