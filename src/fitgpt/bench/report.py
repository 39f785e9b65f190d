"""What `fitgpt bench` measured, shown: the table, and peak memory against step time with its Pareto front."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better on both)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_bench(result: dict, path: Path) -> Path | None:
    """Peak memory against step time, a labelled point per policy, the Pareto front joined."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience; bench.json holds the numbers
        log.warning("matplotlib is not installed: no %s", path)
        return None
    rows = result["rows"]
    pts = [(r["step_seconds"] * 1e3, r["peak_bytes"] / 2**20) for r in rows]
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:gray", zorder=2)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "o-", color="tab:red", zorder=3, label="Pareto front")
    for r, (x, y) in zip(rows, pts):
        spec = r["spec"] if len(r["spec"]) <= 32 else r["spec"][:31] + "…"
        label = r["policy"] if r["policy"] == r["spec"] else f"{r['policy']}\n= {spec}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.margins(x=0.25, y=0.08)
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak memory of a step (MiB)")
    ax.set_title(result["setup"]["workload"], fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]
    setup = result["setup"]
    lines = [
        f"{setup['workload']}; peak from the {setup['peak_source']}, median of {setup['repeats']} interleaved steps "
        f"(noise: {setup.get('noise', 0):.1%} median absolute deviation)",
        "",
        "| policy | peak (MiB) | activations (MiB) | GFLOPs/step | step (ms) | tokens/s | peak saved | activations saved | "
        f"time vs {base['policy']} | predicted | FLOPs vs {base['policy']} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = f"`{r['policy']}`" + (f" = `{r['spec']}`" if r["spec"] != r["policy"] else "")
        predicted = "-"
        if r.get("predicted_seconds") and base.get("predicted_seconds"):
            predicted = f"{r['predicted_seconds'] / base['predicted_seconds']:.2f}x" + ("" if r["predicted_exact"] else "*")
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:.1f} | {r['activation_bytes'] / 2**20:.1f} | {r['flops'] / 1e9:.1f} | "
            f"{r['step_seconds'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {1 - r['peak_bytes'] / base['peak_bytes']:.1%} | "
            f"{1 - r['activation_bytes'] / base['activation_bytes']:.1%} | {r['step_seconds'] / base['step_seconds']:.2f}x | "
            f"{predicted} | {r['flops'] / base['flops']:.3f}x |"
        )
    lines.append(f"\npredicted: the planner's step-time ratio ({setup.get('time_model') or 'no time model'})"
                 + ("; * the nearest plan the planner composes (groups as blocks recomputed alone, offload left out)"
                    if any(not r.get("predicted_exact", True) for r in rows) else ""))
    return "\n".join(lines)
