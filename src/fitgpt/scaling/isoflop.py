"""Hoffmann et al.'s (2022) approach 2 on a ladder's points: at each compute level every depth reaches, the loss of
each depth there (interpolated in log FLOPs between its own points: its run's end and its cooldown branches), a
parabola in log N through them, and its minimum, the compute-optimal size; then N_opt ~ C^a across the levels. Set
beside the same optimum from the fitted law (approach 3: the N that minimises L(N, D) with 6 N_c D = C, N_c the
compute parameters of the family's model of N), the two approaches check each other, as Hoffmann et al.'s three
did."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MIN_DEPTHS = 3
"""Depths a level needs for a parabola with a residual (three give one exactly)."""


def _levels(curves: dict[int, np.ndarray]) -> list[float]:
    """The points' own compute levels (log FLOPs) that at least MIN_DEPTHS depths' ranges hold, at most one per
    factor of 1.5 (the levels of one design are a quarter, a half and the whole of its top)."""
    logs = sorted({float(x) for c in curves.values() for x in c[:, 0]})
    held = [x for x in logs if sum(c[0, 0] - 1e-9 <= x <= c[-1, 0] + 1e-9 for c in curves.values()) >= MIN_DEPTHS]
    out: list[float] = []
    for x in held:
        if not out or x - out[-1] > np.log(1.5):
            out.append(x)
    return out


def _law_optimum(law, flops: float, compute_of: Callable[[float], float], lo: float, hi: float) -> float:
    grid = np.exp(np.linspace(np.log(lo), np.log(hi), 400))
    losses = [law.predict(n, flops / (6 * compute_of(n)))[0] for n in grid]
    return float(grid[int(np.argmin(losses))])


def iso_flop(law, compute_of: Callable[[float], float]) -> dict:
    """Approach 2 on ``law``'s points beside approach 3's optimum (``compute_of``: a size's compute parameters)."""
    by_depth: dict[int, list] = {}
    for p in law.points:
        flops = p.get("flops") or 6.0 * compute_of(p["n_params"]) * p["tokens"]
        by_depth.setdefault(p["n_params"], []).append((np.log(flops), p["val_loss"]))
    curves = {n: np.array(sorted(v)) for n, v in by_depth.items()}
    sizes = sorted(curves)
    lo, hi = sizes[0] / 10, sizes[-1] * 10
    levels = []
    for x in _levels(curves):
        held = [n for n in sizes if curves[n][0, 0] - 1e-9 <= x <= curves[n][-1, 0] + 1e-9]
        losses = [float(np.interp(x, curves[n][:, 0], curves[n][:, 1])) for n in held]
        a, b, _ = np.polyfit(np.log(held), losses, 2)
        vertex = -b / (2 * a) if a > 0 else None
        inside = vertex is not None and np.log(held[0]) <= vertex <= np.log(held[-1])
        levels.append({"flops": float(np.exp(x)), "n_params": held, "losses": losses,
                       "n_opt": float(np.exp(vertex)) if inside else None,
                       "edge": None if inside else ("smallest" if (vertex is None and losses[0] < losses[-1]) or
                                                    (vertex is not None and vertex < np.log(held[0])) else "largest"),
                       "n_opt_law": _law_optimum(law, float(np.exp(x)), compute_of, lo, hi)})
    found = [lv for lv in levels if lv["n_opt"]]
    out = {"levels": levels, "exponent": None, "exponent_law": None}
    if len(found) >= 2:
        x = np.log([lv["flops"] for lv in found])
        out["exponent"] = float(np.polyfit(x, np.log([lv["n_opt"] for lv in found]), 1)[0])
        out["exponent_law"] = float(np.polyfit(x, np.log([lv["n_opt_law"] for lv in found]), 1)[0])
    return out
