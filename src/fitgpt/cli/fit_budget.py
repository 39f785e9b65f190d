"""`fitgpt fit --time-budget 4m [--law law.json]`: which model the time buys, a row per depth, the pick last."""

from __future__ import annotations

import dataclasses
import json
import time

from fitgpt.cli import command_started
from fitgpt.command import train_command
from fitgpt.data.loader import TokenData
from fitgpt.data.prepare import ensure_prepared
from fitgpt.device import resolve_device
from fitgpt.errors import UserError
from fitgpt.memory.tracker import round_up
from fitgpt.plan.budget import PUBLISHED, budget_rows
from fitgpt.scaling.law import read_law
from fitgpt.units import format_bytes, format_count, format_duration, parse_duration


def _data(cfg):
    """The data's meta (prepared on first use, as training does), and the law checked against its tokenizer."""
    data_cfg, meta = ensure_prepared(cfg.data, progress=False)
    data = TokenData(data_cfg.path, meta)
    law = read_law(cfg.law) if cfg.law else None
    if law is not None and (law.data["tokenizer_sha256"] != data.tokenizer_sha256 or
                            law.data["vocab_size"] != data.vocab_size):
        raise UserError(f"--law {cfg.law} was fitted on data of another tokenizer (vocabulary {law.data['vocab_size']}) "
                        f"than --data.dir {data_cfg.path} (vocabulary {data.vocab_size}): fit one on this data with "
                        f"fitgpt ladder --data.dir {data_cfg.path}, or name its own data")
    return data_cfg, data, law


def fitted_on(law, meta: dict) -> str:
    """Whether ``law``'s points were measured on this data's split (its training tokens), or on this tokenizer's data
    prepared otherwise: other inputs, or the split an older fitgpt drew from the files' paths, whose validation
    windows are not these (the built-in corpus: 3,663,509 training tokens then, 3,817,401 now)."""
    if int(law.data["unique_tokens"]) == int(meta["train_tokens"]):
        return "fitted on this data"
    return (f"fitted on this tokenizer's data prepared otherwise, {int(law.data['unique_tokens']):,} training tokens "
            f"against these {int(meta['train_tokens']):,}: its losses are of other validation windows")


def _laws_recipe(law, train):
    """``train`` with the learning rates the law's points trained with (under muP, depth 1's: every depth's by
    transfer) and their evaluation's batches, for the rows' commands: the law speaks of runs of its own recipe, and
    their loss is measured as its points' were."""
    if law is None:
        return train
    r, optim = law.recipe, train.optim
    if isinstance(r.get("lr"), (int, float)):
        # To 12 digits: a law of an older ladder saved lr / 10 unrounded, and its commands said 0.0006000000000000001.
        optim = dataclasses.replace(optim, lr=float(r["lr"]), min_lr=float(f"{float(r.get('min_lr', optim.min_lr)):.12g}"))
    batches = r.get("eval_batches")
    return dataclasses.replace(train, optim=optim, eval_batches=batches if isinstance(batches, int) and batches > 0
                               else train.eval_batches)


def _beyond(law, row) -> str:
    """How far past the law's own points a row's prediction reaches: its compute over their largest, its parameters
    over their largest (or below their least). A law speaks with its interval inside them; past them it extrapolates."""
    if law is None:
        return "(no law of yours)"
    most_flops = law.compute_range()[1]
    sizes = [p["n_params"] for p in law.points]
    parts = [f"{row.flops / most_flops:.1f}x their compute"] if row.flops > most_flops else []
    parts += [f"{row.n_params / max(sizes):.1f}x their parameters"] if row.n_params > max(sizes) else []
    parts += [f"{min(sizes) / row.n_params:.1f}x below their parameters"] if row.n_params < min(sizes) else []
    return ", ".join(parts) or "inside"


def time_budget(cfg) -> int:
    seconds = parse_duration(cfg.time_budget)
    data_cfg, data, law = _data(cfg)
    unique = float(cfg.unique_tokens or data.meta["train_tokens"])
    # The law's points were trained in one precision: the rows train in it too (without a law, the fastest).
    precision = law.recipe.get("precision", cfg.precision) if law and cfg.precision == "auto" else cfg.precision
    w = cfg.workload.vary(model=dataclasses.replace(cfg.model, vocab_size=round_up(data.vocab_size, 64)),
                          precision=precision)
    w = dataclasses.replace(w, train=_laws_recipe(law, dataclasses.replace(w.train, data=data_cfg)))
    here = None if (cfg.gpu or cfg.target) else w.device if not w.fake else resolve_device("auto")
    rows, pick = budget_rows(w, cfg.budget, seconds, law, unique, here)
    if not rows:
        raise UserError(f"depth 1 of the family does not fit --memory-budget {format_bytes(cfg.budget)} at batch "
                        f"{w.train.batch_size} x {w.context}, or trains not one step in --time-budget "
                        f"{cfg.time_budget}: lower --batch-size or --context, or give it more time")

    whose = (f"law {cfg.law} ({fitted_on(law, data.meta)}: {len(law.points)} points, rms log residual "
             f"{law.rms_residual:.3f}; interval: its bootstrap's 5th to 95th percentile)" if law else
             f"PUBLISHED coefficients (Hoffmann et al. 2022: E={PUBLISHED.E}, A={PUBLISHED.A}, alpha={PUBLISHED.alpha}, "
             f"B={PUBLISHED.B}, beta={PUBLISHED.beta}), fitted on another corpus and tokenizer: their losses rank the "
             "rows and mean nothing on their own; fit yours with fitgpt ladder")
    print(f"What {format_duration(seconds)} of training buys on {w.where()} ({cfg.world_size or 1} process"
          f"{'es' if (cfg.world_size or 1) > 1 else ''}), memory budget {format_bytes(cfg.budget)}, "
          f"{w.train.batch_size * w.train.grad_accum} x {w.context} tokens a step, on {data_cfg.path} "
          f"({unique:,.0f} unique tokens{', --unique-tokens' if cfg.unique_tokens else ''}); the loss from the {whose}:\n")
    print("| # | depth x width | parameters | micro-batch x accum | precision | parallel | checkpointing | peak | "
          "tokens/s | tokens | epochs | predicted loss | beyond the law's points |")
    print("|---:|---|---:|---|---|---|---|---:|---:|---:|---:|---|---|")
    for i, r in enumerate(rows):
        c = r.choice
        interval = f" ({r.low:.3f} to {r.high:.3f})" if law else " (published law)"
        print(f"| {i}{' pick' if i == pick else ''} | {r.depth} x {r.width} | {format_count(r.n_params)} | "
              f"{c.micro_batch} x {c.grad_accum} | {c.precision} | {c.layout.name} | `{c.policy}` | {format_bytes(c.peak)} | "
              f"{c.tokens_per_s:,.0f} | {format_count(r.tokens)} | {r.epochs:.2f} | {r.loss:.3f}{interval} | "
              f"{_beyond(law, r)} |")
    commands = [train_command(dataclasses.replace(r.train, time_budget=cfg.time_budget), cfg.world_size or 1)
                for r in rows]
    print(f"\n(parameters: the blocks', as the law counts them; tokens: the time after a start-up, its evaluations "
          f"included, at the predicted tokens/s; epochs of {unique:,.0f} unique tokens, repeats counted as Muennighoff "
          f"et al. 2023; tokens/s: "
          + (f"each row's step timed for real on {here} (the median of its steps over 1.5 s), its configuration chosen by the time model"
             if here is not None else getattr(w.cost, 'source', 'the roofline')) + ")")
    timed = [r.timed for r in rows if r.timed is not None]
    if timed:  # how long the measuring took, and how steady the machine was meanwhile
        spreads = [t.spread for t in timed]
        print(f"steps timed: {len(timed)} rows in {sum(t.seconds for t in timed):.1f}s of this command's "
              f"{time.perf_counter() - command_started():.1f}s; their steps within +-{min(spreads):.1%} to "
              f"+-{max(spreads):.1%} of each row's median (half the interquartile range): a machine busier when it "
              "trains than now trains fewer tokens than a row says")
    for i, command in enumerate(commands):
        print(f"{'pick' if i == pick else f'row {i}'}: {command}")
    print(json.dumps({"rows": [r.as_json(command) for r, command in zip(rows, commands)], "pick": pick,
                      "law": cfg.law or "published", "time_budget_seconds": seconds, "memory_budget": cfg.budget}))
    return 0
