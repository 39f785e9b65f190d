"""The largest model each card pretrains under the settings of issue 44, beside the one before them, at batch
1 x 2048 and at GaLore's 16 x 256: `fitgpt fit --largest-model`'s searches (the llama-1b shape, bf16, the card's
memory less the CUDA context), for the rungs named, on every card of the table.

    python benchmarks/largest.py            # about 25 s a search on 2 cores: 5 cards x 2 shapes x 3 settings
    python benchmarks/largest.py --cards rtx-4090 --shapes 1x2048
    python benchmarks/largest.py --cards rtx-4090 --shapes 1x2048 --blocks 31   # one size (31 blocks: 7.06B), timed

Prints a Markdown table for benchmarks/RESULTS.md: each setting's largest model, and its tokens/s as planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from fitgpt.cli.workload import BudgetConfig
from fitgpt.plan import PlanError, solve
from fitgpt.plan.family import LADDER, MODEL_SETTINGS, largest_model, scaled

CARDS = ("rtx-4090", "l4", "a100-40gb", "a100-80gb", "h100-80gb")
BEFORE = "4-bit AdamW, step in the backward"
RUNGS = (BEFORE, "Adafactor, bf16 weights (stochastic rounding), step in the backward",
         "APOLLO-Mini, bf16 weights (stochastic rounding), step in the backward")


def at_size(card: str, batch: int, context: int, blocks: int) -> None:
    """Each setting's fastest plan that fits at one depth, and its tokens/s, with clipping (two passes a step in the
    backward) and without (one)."""
    flags = BudgetConfig(preset="llama-1b", gpu=card, batch_size=batch, context=context, grad_accum=1)
    w, model = flags.workload, scaled(flags.workload.train.model, blocks)
    print(f"| setting ({card}, {blocks} x {model.n_embed}, {batch} x {context}) | clipping | peak GiB | tokens/s | plan |")
    print("|---|---|---:|---:|---|")
    for name, changes in LADDER:
        if name not in RUNGS:
            continue
        for clip in (1.0, 0.0):
            optim = dataclasses.replace(w.train.optim, grad_clip=clip,
                                        **{k: v for k, v in changes.items() if k not in MODEL_SETTINGS})
            m = dataclasses.replace(model, **{k: v for k, v in changes.items() if k in MODEL_SETTINGS})
            try:
                plan, pred = solve(w.vary(model=m, optim=optim, grad_accum=1).profile(), flags.budget)
            except PlanError:
                print(f"| {name} | {clip:g} | - | - | does not fit |", flush=True)
                continue
            print(f"| {name} | {clip:g} | {pred.peak / 2**30:.2f} | {batch * context / pred.step_time:,.0f} | "
                  f"`{plan.spec()}` |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cards", nargs="+", default=list(CARDS))
    ap.add_argument("--shapes", nargs="+", default=["1x2048", "16x256"], help="BATCHxCONTEXT")
    ap.add_argument("--blocks", type=int, help="time one depth of the shape under each setting instead")
    args = ap.parse_args()
    if args.blocks:
        for shape in args.shapes:
            for card in args.cards:
                at_size(card, *(int(x) for x in shape.split("x")), args.blocks)
        return
    ladder = tuple(r for r in LADDER if r[0] in RUNGS)
    print("| card | batch | " + " | ".join(f"{name} | tokens/s" for name in RUNGS) + " | vs before |")
    print("|---|---|" + "---:|---:|" * len(RUNGS) + "---:|")
    for shape in args.shapes:
        batch, context = (int(x) for x in shape.split("x"))
        for card in args.cards:
            flags = BudgetConfig(preset="llama-1b", gpu=card, batch_size=batch, context=context, grad_accum=1)
            t0 = time.perf_counter()
            rows = {r.setting: r for r in largest_model(flags.workload, flags.budget, ladder=ladder)}
            cells = [f"{rows[n].params / 1e9:.2f}B ({rows[n].model.n_blocks} x {rows[n].model.n_embed}) | "
                     f"{rows[n].tokens_per_s:,.0f}" if rows[n].model else f"- ({rows[n].note}) | -" for n in RUNGS]
            best = max(rows[n].params for n in RUNGS)
            print(f"| {card} | {batch} x {context} | " + " | ".join(cells) + f" | {best / max(rows[BEFORE].params, 1):.2f}x |"
                  f" <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
