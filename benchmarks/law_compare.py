"""Two ladders' laws side by side, pooled, and with N counted with the head's matrix (Porian et al. 2024), each
against the 12-minute runs trained beyond the ladders (RESULTS, "A law that predicts": `benchmarks/budget.py run`).

    python benchmarks/law_compare.py benchmarks/law/law.json benchmarks/law/seed2/law.json

Prints each fit's coefficients with their bootstrap 5-95% intervals, and its prediction for each 12-minute run
against the loss measured."""

from __future__ import annotations

import argparse
import json

import numpy as np

from fitgpt.scaling.law import Law, fit_law

# (depth, non-embedding parameters, compute parameters, tokens trained, measured loss): the 12-minute runs of RESULTS.
MEASURED = [(2, 100_096, 231_168, 20_469_760, 3.232), (3, 335_712, 532_320, 14_424_064, 3.040),
            (4, 793_344, 1_055_488, 8_562_688, 3.058)]


def report(name: str, law: Law, key: str) -> None:
    c = law.coefficients

    def q(f: str) -> str:
        lo, hi = np.percentile([getattr(b, f) for b in law.bootstrap], [5, 95])
        return f"({lo:.3g}-{hi:.3g})"

    print(f"{name}: E {c.E:.3f} {q('E')}, A {c.A:.4g}, alpha {c.alpha:.3f} {q('alpha')}, B {c.B:.4g}, "
          f"beta {c.beta:.3f} {q('beta')}; rms log residual {law.rms_residual:.4f}; problems: {law.problems() or 'none'}")
    for depth, n, compute, tokens, measured in MEASURED:
        pred, lo, hi = law.predict(n if key == "n_params" else compute, tokens)
        print(f"  depth {depth}: predicted {pred:.3f} ({lo:.3f}-{hi:.3f}), measured {measured:.3f}: "
              f"{100 * (pred / measured - 1):+.1f}%")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("laws", nargs="+", help="law.json files of ladders on the same data")
    ap.add_argument("--resamples", type=int, default=100)
    args = ap.parse_args()
    laws = [json.load(open(p)) for p in args.laws]
    data = laws[0]["data"]
    for key in ("n_params", "compute_params"):
        pooled = []
        for path, lj in zip(args.laws, laws):
            points = [{**p, "n_params": p[key]} for p in lj["points"]]
            pooled += points
            report(f"{path} [N: {key}]", fit_law(points, data, {}, resamples=args.resamples), key)
        if len(laws) > 1:
            report(f"pooled [N: {key}]", fit_law(pooled, data, {}, resamples=args.resamples), key)


if __name__ == "__main__":
    main()
