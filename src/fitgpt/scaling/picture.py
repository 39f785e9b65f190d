"""A law drawn: on the left, each point's loss (with its evaluation's standard error) against its tokens, a colour a
model size, with the law's curve for each size; in the middle, the iso-FLOP profiles (approach 2): each compute
level's losses against N, its parabola and its optimum, beside the law's optimum at that compute (approach 3); on the
right, the loss against training compute (6 N D), the points, and the law's compute-optimal frontier."""

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
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(17, 4.8))
    d_all = [p["tokens"] for p in law.points]
    grid = np.geomspace(min(d_all) / 2, max(d_all) * 4, 100)
    for n, colour in zip(sizes, colours):
        pts = [p for p in law.points if p["n_params"] == n]
        left.errorbar([p["tokens"] for p in pts], [p["val_loss"] for p in pts], fmt="o", color=colour, zorder=3,
                      yerr=[p.get("val_loss_se") or 0.0 for p in pts], label=f"N = {n / 1e6:.3f}M")
        left.plot(grid, [c.loss(n, effective_tokens(d, unique)) for d in grid], color=colour, lw=1)
        right.scatter([6 * n * p["tokens"] for p in pts], [p["val_loss"] for p in pts], color=colour, zorder=3)
    flops = np.geomspace(6 * min(sizes) * min(d_all) / 2, 6 * max(sizes) * max(d_all) * 8, 100)
    best_n = np.array([c.optimal_params(f) for f in flops])
    right.plot(flops, c.loss(best_n, flops / (6 * best_n)), "k--", lw=1.5, label="compute-optimal frontier")
    left.set(xscale="log", xlabel="tokens D", ylabel="val loss", title=f"{len(law.points)} points, "
             f"rms log residual {law.rms_residual:.3f}")
    right.set(xscale="log", xlabel="training compute 6 N D (FLOPs)", ylabel="val loss",
              title=f"E={c.E:.2f} A={c.A:.3g} alpha={c.alpha:.2f} B={c.B:.3g} beta={c.beta:.2f}")
    _iso_flop(middle, law, plt)
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _iso_flop(ax, law: Law, plt) -> None:
    levels = law.iso_flop.get("levels", [])
    colours = plt.cm.plasma(np.linspace(0, 0.8, max(1, len(levels))))
    for lv, colour in zip(levels, colours):
        x = np.log(lv["n_params"])
        ax.scatter(lv["n_params"], lv["losses"], color=colour, zorder=3, label=f"C = {lv['flops']:.2g} FLOPs")
        if len(x) >= 3:
            fit = np.polyfit(x, lv["losses"], 2)
            grid = np.linspace(x.min(), x.max(), 50)
            ax.plot(np.exp(grid), np.polyval(fit, grid), color=colour, lw=1)
        if lv["n_opt"]:
            ax.axvline(lv["n_opt"], color=colour, lw=1, ls=":")
        ax.axvline(lv["n_opt_law"], color=colour, lw=1, ls="--")
    ax.set(xscale="log", xlabel="non-embedding parameters N", ylabel="val loss (interpolated at the level)",
           title="iso-FLOP profiles: dotted, their optimum; dashed, the law's" if levels else "no level holds 3 depths")
    if levels:
        ax.legend(fontsize=7)
