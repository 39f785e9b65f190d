"""Why the ladders' laws miss the 12-minute runs (RESULTS, "A law that predicts"): each size's slope in log D, inside
the ladder and on to its 12-minute run, beside the law's, and the same points refitted other ways, each against the
12-minute runs on the law's 20 windows. No runs: the law files' points.

    python benchmarks/law_slopes.py benchmarks/law/law.json benchmarks/law/seed2/law.json
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from scipy.optimize import least_squares

from fitgpt.scaling.law import Law, fit_law, read_law

# (depth, non-embedding parameters, tokens, loss on the law's first 20 validation windows): the 12-minute runs.
MEASURED_20 = [(2, 100_096, 20_469_760, 3.279), (3, 335_712, 14_424_064, 3.080), (4, 793_344, 8_562_688, 3.101)]


def slopes(name: str, law: Law) -> None:
    """Each depth's loss an e-fold of tokens between its last two points, and on to its 12-minute run: measured, and
    the law's -beta B / D^beta at the span's middle."""
    c = law.coefficients
    runs = {d: (t, v) for d, _, t, v in MEASURED_20}

    def law_slope(d0: float, d1: float) -> float:
        return -c.beta * c.B * math.sqrt(d0 * d1) ** -c.beta

    by_depth: dict[int, list] = {}
    for p in law.points:
        by_depth.setdefault(p["depth"], []).append((p["tokens"], p["val_loss"]))
    for depth, pts in sorted(by_depth.items()):
        (d0, l0), (d1, l1) = sorted(pts)[-2:]
        line = (f"{name} depth {depth}: {d0 / 1e6:.1f}M-{d1 / 1e6:.1f}M {(l1 - l0) / math.log(d1 / d0):+.3f} an e-fold "
                f"(law {law_slope(d0, d1):+.3f})")
        if depth in runs:
            t, v = runs[depth]
            line += f"; on to {t / 1e6:.1f}M {(v - l1) / math.log(t / d1):+.3f} (law {law_slope(d1, t):+.3f})"
        print(line)


def misses(predict, rows: list[tuple] = MEASURED_20) -> str:
    """``predict(n, tokens)`` against each of ``rows`` (depth, n, tokens, loss), as a percentage."""
    return ", ".join(f"{100 * (predict(n, t) / v - 1):+.1f}%" for _, n, t, v in rows)


def law_misses(law: Law, rows: list[tuple] = MEASURED_20) -> str:
    return misses(lambda n, t: law.predict(n, t)[0], rows)


def kaplan(points: list[dict]):
    """Kaplan et al.'s L = E + ((N_c / N)^(a_N / a_D) + D_c / D)^a_D, whose data term depends on N: Huber on log L."""
    n, d = (np.array([p[k] for p in points], dtype=float) for k in ("n_params", "tokens"))
    loss = np.array([p["val_loss"] for p in points])

    def form(t, n, d):
        e, log_nc, a_n, log_dc, a_d = t
        return e + (np.exp((a_n / a_d) * (log_nc - np.log(n))) + np.exp(log_dc - np.log(d))) ** a_d

    starts = [[e, lnc, an, ldc, ad] for e in (0, 1.5, 3) for lnc in (5, 10, 15) for an in (0.1, 0.5)
              for ldc in (10, 15) for ad in (0.1, 0.5)]
    bounds = ([0, -10, 0.01, -10, 0.01], [loss.min(), 60, 3, 60, 3])
    with np.errstate(over="ignore"):
        fits = [least_squares(lambda t: np.log(form(t, n, d)) - np.log(loss), s, bounds=bounds, loss="huber",
                              f_scale=1e-3) for s in starts]
    best = min(fits, key=lambda r: r.cost).x
    return lambda n_, t_: float(form(best, n_, t_))


def refits(name: str, law: Law) -> None:
    pts = law.points
    print(f"{name} as fitted: {law_misses(law)}")
    for label, keep in (("without depth 1", lambda p: p["depth"] > 1),
                        *((f"points past {x} tokens a parameter", lambda p, x=x: p["tokens"] >= x * p["n_params"])
                          for x in (3, 10, 20))):
        chosen = [p for p in pts if keep(p)]
        if len(chosen) >= 6:
            print(f"{name} {label} ({len(chosen)} points): {law_misses(fit_law(chosen, law.data, {}, resamples=0))}")
    print(f"{name} Kaplan's form: {misses(kaplan(pts))}")
    depth, n, tokens, loss = MEASURED_20[0]
    long2 = {"depth": depth, "n_params": n, "tokens": tokens, "val_loss": loss, "how": "the 12-minute run"}
    with_long = fit_law([p for p in pts if p["depth"] > 1] + [long2], law.data, {}, resamples=0)
    print(f"{name} without depth 1, with depth 2's 12-minute run as a point (depths 3, 4 out of sample): "
          + law_misses(with_long, MEASURED_20[1:]))
    inside = fit_law([p for p in pts if p["how"] != "end"], law.data, {}, resamples=0)
    ends = [(p["depth"], p["n_params"], p["tokens"], p["val_loss"]) for p in pts if p["how"] == "end"]
    print(f"{name} inside the ladder, fitted without the depths' ends: the ends {law_misses(inside, ends)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("laws", nargs="+", help="law.json files of ladders on the built-in corpus")
    args = ap.parse_args()
    laws = {p: read_law(p) for p in args.laws}
    for name, law in laws.items():
        slopes(name, law)
    print("predicted against measured, depths 2, 3 and 4:")
    for name, law in laws.items():
        refits(name, law)
    pooled = [p for law in laws.values() for p in law.points if p["depth"] > 1]
    first = next(iter(laws.values()))
    if len(laws) > 1:
        print(f"pooled without depth 1 ({len(pooled)} points): {law_misses(fit_law(pooled, first.data, {}, resamples=0))}")
    print(json.dumps({"measured": MEASURED_20}))


if __name__ == "__main__":
    main()
