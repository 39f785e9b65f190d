"""A law drawn: on the left, each point's loss against its tokens, a colour a model size, with the law's curve for
each size; on the right, the loss against training compute (6 N D), the points, and the compute-optimal frontier
(the law's least loss at each compute, and the N it takes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fitgpt.scaling.law import Law, effective_tokens


def draw_law(law: Law, out: Path) -> Path | None:
    """law.png at ``out`` (None where matplotlib is not installed)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    c, unique = law.coefficients, law.data["unique_tokens"]
    sizes = sorted({p["n_params"] for p in law.points})
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(sizes)))
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    d_all = [p["tokens"] for p in law.points]
    grid = np.geomspace(min(d_all) / 2, max(d_all) * 4, 100)
    for n, colour in zip(sizes, colours):
        pts = [p for p in law.points if p["n_params"] == n]
        left.scatter([p["tokens"] for p in pts], [p["val_loss"] for p in pts], color=colour, zorder=3,
                     label=f"N = {n / 1e6:.2f}M")
        left.plot(grid, [c.loss(n, effective_tokens(d, unique)) for d in grid], color=colour, lw=1)
        right.scatter([6 * n * p["tokens"] for p in pts], [p["val_loss"] for p in pts], color=colour, zorder=3)
    flops = np.geomspace(6 * min(sizes) * min(d_all) / 2, 6 * max(sizes) * max(d_all) * 8, 100)
    best_n = np.array([c.optimal_params(f) for f in flops])
    right.plot(flops, c.loss(best_n, flops / (6 * best_n)), "k--", lw=1.5, label="compute-optimal frontier")
    left.set(xscale="log", xlabel="tokens D", ylabel="val loss", title=f"{len(law.points)} points, "
             f"rms log residual {law.rms_residual:.3f}")
    right.set(xscale="log", xlabel="training compute 6 N D (FLOPs)", ylabel="val loss",
              title=f"E={c.E:.2f} A={c.A:.3g} alpha={c.alpha:.2f} B={c.B:.3g} beta={c.beta:.2f}")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
