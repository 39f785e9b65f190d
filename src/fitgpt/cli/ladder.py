"""`fitgpt ladder --time-budget 8m`: train a ladder of small models on your data, fit the scaling law, write law.json
and law.png."""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import tyro

from fitgpt.cli import command_started
from fitgpt.cli.workload import unchecked_default
from fitgpt.config import load_config, load_config_named_in, to_dict
from fitgpt.data.config import DataConfig
from fitgpt.errors import UserError, require_not_empty
from fitgpt.units import format_duration, parse_duration
from fitgpt.utils import writable_dir


@dataclass
class LadderConfig:
    """Train the family of shapes set by depth (width --aspect a block) at the --depths its design keeps for the
    budget, on your data, within --time-budget, and fit the scaling law L(N, D) = E + A/N^alpha + B/D^beta through
    their losses (and the iso-FLOP profiles of the same points beside it)."""

    time_budget: Optional[str] = None
    """How long the whole ladder may take, fit included, e.g. 8m, 1h."""
    out: str = "law.json"
    """The law file to write (its picture beside it, with .png)."""
    depths: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    """The family's depths the design may train: from the smallest up, as many as the budget gives every point
    enough tokens a parameter (0.5), spanning 10x in parameters at the least; three points each."""
    aspect: int = 64
    """The family's width a block (n_embed = aspect x depth): 64 as nanochat's; 32 gives smaller models, for a
    budget too small to identify a law with 64."""
    mup: bool = True
    """Every depth muP + CompleteP over depth 1 (--model.mup-base-width, --model.mup-base-depth): the recipe's
    learning rate, good at depth 1, is good at each (benchmarks/lr_transfer.py); --no-mup: the same rate for all."""
    work_dir: str = "runs/ladder"
    """Where the ladder's runs go, a run directory each (their checkpoints, metrics and logs: the points' evidence)."""
    overwrite: bool = False
    """Replace an earlier ladder's runs in --work-dir and its --out."""
    preset: str = "tiny"
    """The recipe each rung trains with (batch, context, learning rate, warmup, optimizer, architecture)."""
    config: Optional[str] = None
    """A JSON config file (for example a run's config.json) applied over the preset, as for fitgpt train."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data, as fitgpt train takes it (--data.dir: your prepared data; prepared on first use)."""
    lr: Optional[float] = None
    """The learning rate of depth 1, where not the recipe's (--optim.lr of --preset or --config): under --mup every
    depth's by transfer, e.g. the best of a sweep at depth 1 (benchmarks/lr_transfer.py). Its --optim.min-lr a tenth
    of it."""
    eval_batches: int = 20
    """Validation batches behind each point's loss (the same windows for every point)."""
    seed: int = 1337
    device: str = "auto"

    def __post_init__(self) -> None:
        require_not_empty(self, ("time_budget", "out", "work_dir", "preset", "config", "device"))
        if self.time_budget is None:
            raise UserError("--time-budget is required: how long the ladder may take, e.g. --time-budget 8m")
        parse_duration(self.time_budget)
        from fitgpt.scaling.family import Family

        Family(self.aspect, self.mup)  # --aspect checked
        if len(set(self.depths)) < 2 or min(self.depths) < 1:
            raise UserError(f"--depths {' '.join(map(str, self.depths))}: give at least two different depths of 1 or more")
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"--lr {self.lr}: give a positive learning rate")
        if self.eval_batches < 1:
            raise UserError("--eval-batches must be at least 1")
        out = Path(self.out)
        if out.is_dir() or out.suffix != ".json":
            raise UserError(f"--out {self.out}: name a .json file, e.g. law.json")
        if (out.exists() or out.with_suffix(".png").exists()) and not self.overwrite:
            raise UserError(f"--out {self.out} exists: add --overwrite to replace it (and its .png), or name another file")
        writable_dir(out.parent, "--out")  # "law.json"'s parent is "."


def _points_table(law) -> None:
    print("| depth | parameters (non-embedding) | tokens | tokens a parameter | FLOPs | val loss (+- s.e.) | law | "
          "residual (log) | how |\n|---:|---:|---:|---:|---:|---|---:|---:|---|")
    for p, r in zip(law.points, law.residuals):
        predicted = law.predict(p["n_params"], p["tokens"])[0]
        se = f" +- {p['val_loss_se']:.4f}" if p.get("val_loss_se") is not None else ""
        print(f"| {p['depth']} | {p['n_params']:,} | {p['tokens']:,} | {p['tokens'] / p['n_params']:.1f} | "
              f"{p.get('flops', 0):.3g} | {p['val_loss']:.4f}{se} | {predicted:.4f} | {r:+.4f} | {p['how']} |")


def _iso_flop_table(law) -> None:
    """Approach 2 beside approach 3: each compute level's optimal size from the points' parabola and from the law."""
    iso = law.iso_flop
    if not iso.get("levels"):
        print("\niso-FLOP profiles: no compute level holds three depths")
        return
    print("\n| FLOPs | depths' losses (N: loss) | N_opt, iso-FLOP parabola (approach 2) | N_opt, the law (approach 3) |"
          "\n|---:|---|---:|---:|")
    for lv in iso["levels"]:
        losses = ", ".join(f"{n:,.0f}: {v:.3f}" for n, v in zip(lv["n_params"], lv["losses"]))
        two = f"{lv['n_opt']:,.0f}" if lv["n_opt"] else f"at the {lv['edge']} depth"
        print(f"| {lv['flops']:.3g} | {losses} | {two} | {lv['n_opt_law']:,.0f} |")
    if iso.get("exponent") is not None:
        print(f"N_opt ~ C^a: a = {iso['exponent']:.3f} from the profiles, {iso['exponent_law']:.3f} from the law")


def run(args: list[str]) -> int:
    base = load_config_named_in(args)
    default = unchecked_default(LadderConfig)
    default.preset, default.config, default.data = base.preset, base.config, base.data
    cfg = tyro.cli(LadderConfig, default=default, args=args, prog="fitgpt ladder")
    train_cfg = load_config(cfg.preset, cfg.config, {"data": dataclasses.asdict(cfg.data) | {"inputs": list(cfg.data.inputs)},
                                                     "eval_batches": cfg.eval_batches, "seed": cfg.seed,
                                                     "device": cfg.device})
    from fitgpt.scaling.family import Family
    from fitgpt.scaling.ladder import LadderStopped, run_ladder

    if cfg.lr is not None:
        optim = dataclasses.replace(train_cfg.optim, lr=cfg.lr, min_lr=float(f"{cfg.lr / 10:.6g}"))
        train_cfg = dataclasses.replace(train_cfg, optim=optim)
    from fitgpt.scaling.picture import draw_law

    budget = parse_duration(cfg.time_budget)
    try:  # counted from the command's start: the imports and the data's preparation too
        law = run_ladder(train_cfg, budget, tuple(sorted(set(cfg.depths))), Path(cfg.work_dir), cfg.overwrite,
                         started=command_started(), family=Family(cfg.aspect, cfg.mup))
    except (LadderStopped, KeyboardInterrupt) as e:
        print(f"fitgpt ladder: {e or 'interrupted'}; the depths it finished are kept in {cfg.work_dir} (ladder.json): "
              "the same command continues it, their time counted", file=sys.stderr)
        return 130
    out = Path(cfg.out)
    law.write(out)
    png = draw_law(law, out.with_suffix(".png"))
    c = law.coefficients
    _points_table(law)
    _iso_flop_table(law)
    print(f"\nlaw: L = {c.E:.3f} + {c.A:.4g} / N^{c.alpha:.3f} + {c.B:.4g} / D^{c.beta:.3f}, fitted on {len(law.points)} "
          f"points (rms log residual {law.rms_residual:.4f}; {len(law.bootstrap)} bootstrap refits), on "
          f"{law.data['dir']} (vocabulary {law.data['vocab_size']}, {law.data['unique_tokens']:,} unique tokens) "
          f"in {format_duration(budget)}")
    print(f"wrote {out}" + (f" and {png}" if png else " (no picture: matplotlib is not installed)")
          + f"; use it: fitgpt fit --law {out} --time-budget 4m --data.dir {law.data['dir']}")
    print(json.dumps({"law": str(out), "coefficients": dataclasses.asdict(c), "points": len(law.points),
                      "rms_log_residual": law.rms_residual, "config": to_dict(train_cfg)["data"]}))
    return 0
