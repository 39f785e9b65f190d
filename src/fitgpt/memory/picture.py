"""Where the memory goes: a step's snapshot (`fitgpt.memory.snapshot`, predicted or measured) as bytes alive over the
step, stacked by category, and drawn.

A tensor's category is read from when it was made and when it was freed (the phases its frames name): the weights;
what is made before the step (DDP's buckets, cuBLAS workspaces); the optimizer state (made by the first optimizer
step and kept); gradients (made in a backward, kept past it); activations kept (made in a forward, freed in the
backward); the logits and loss (made by the head); recompute and backward temporaries (made and freed in a
backward); forward temporaries (made and freed in the forward); the whole matrices an optimizer step gathers from
the ranks' shards (made in the step by a collective: a whole-matrix optimizer's, `fitgpt.optim.whole`), the step's
other temporaries; and, from an allocator model, reserved but not allocated (the cache and its fragmentation).
"""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

from fitgpt.units import format_bytes

log = logging.getLogger(__name__)

GATHERED = "whole matrices gathered for the step"
CATEGORIES = ("weights", "made before the step", "optimizer state", "gradients", "activations kept", "logits and loss",
              "recompute and backward temporaries", "forward temporaries", GATHERED, "optimizer step temporaries")
RESERVED = "reserved, not allocated"
COLORS = dict(zip((*CATEGORIES, RESERVED), [f"C{i}" for i in range(len(CATEGORIES))] + ["lightgrey"]))
"""Matplotlib's ten cycle colours, one a category, and grey for the cache (an eleventh would repeat the weights')."""


def _kind(phase: str) -> str:
    """forward, backward, optimizer, head, or the phase itself for what is made outside the steps."""
    body = phase.split(": ", 1)[1] if phase.startswith("step ") else phase
    if body.startswith("forward, head"):
        return "head"
    for kind in ("forward", "backward", "optimizer"):
        if body.startswith(kind):
            return kind
    return phase


def _category(made: str, freed: str | None, op: str = "") -> str:
    """``made``, ``freed``: the phases of a tensor's birth and death; ``op``: what made it."""
    kind, gone = _kind(made), _kind(freed) if freed else None
    if made in ("weights", "gradients held"):
        return "weights" if made == "weights" else "gradients"
    if made == "optimizer state":
        return "optimizer state"
    if kind == "head":
        return "logits and loss"
    if kind == "forward":
        return "forward temporaries" if gone in ("forward", "head") else "activations kept"
    if kind == "backward":
        return "recompute and backward temporaries" if gone == "backward" else "gradients"
    if kind == "optimizer":
        if gone is None:
            return "optimizer state"
        return GATHERED if "c10d" in op else "optimizer step temporaries"
    return "made before the step"


def timeline(snapshot: dict) -> dict[str, list[int]]:
    """Bytes alive after each event of the snapshot's trace, by category (``CATEGORIES``, then ``RESERVED``)."""
    events = snapshot["device_traces"][0]
    made: dict[int, tuple[int, str, str]] = {}  # address -> (index of its alloc, phase, op)
    life: list[tuple[int, int | None, int, str, str | None, str]] = []  # (alloc, free index, bytes, made, freed, op)
    for i, e in enumerate(events):
        frame = (e.get("frames") or [{"filename": ""}])[0]
        phase = frame["filename"]
        if e["action"] == "alloc":
            made[e["addr"]] = (i, phase, frame.get("name", ""))
        elif e["action"] == "free_completed" and e["addr"] in made:
            j, born, op = made.pop(e["addr"])
            life.append((j, i, e["size"], born, phase, op))
    sizes = {e["addr"]: e["size"] for e in events if e["action"] == "alloc"}
    life += [(j, None, sizes[a], born, None, op) for a, (j, born, op) in made.items()]
    n = len(events)
    series = {c: [0] * (n + 1) for c in (*CATEGORIES, RESERVED)}
    for j, i, nbytes, born, freed, op in life:  # a difference array per category, summed below
        s = series[_category(born, freed, op)]
        s[j] += nbytes
        if i is not None:
            s[i] -= nbytes
    reserved, r = [0] * (n + 1), 0
    for i, e in enumerate(events):
        r += e["size"] if e["action"] == "segment_alloc" else -e["size"] if e["action"] == "segment_free" else 0
        reserved[i] = r
    for c in CATEGORIES:
        total = 0
        for i in range(n + 1):
            total += series[c][i]
            series[c][i] = total
    allocated = [sum(series[c][i] for c in CATEGORIES) for i in range(n)]
    series[RESERVED] = [max(0, reserved[i] - allocated[i]) for i in range(n)]
    return {c: v[:n] for c, v in series.items()}


def peak_of(series: dict[str, list[int]]) -> tuple[int, dict[str, int]]:
    """The event at which the most is allocated, and what each category holds there."""
    allocated = [sum(series[c][i] for c in CATEGORIES) for i in range(len(series[CATEGORIES[0]]))]
    at = max(range(len(allocated)), key=allocated.__getitem__) if allocated else 0
    return at, {c: series[c][at] for c in (*CATEGORIES, RESERVED) if series[c] and series[c][at]}


def draw(panels: list[tuple[str, dict]], path: str | Path, budget: int | None = None, card: int | None = None,
         title: str = "", rows: int = 1) -> Path | None:
    """``panels``: (label, snapshot) on one scale, in ``rows`` rows (filled column by column), memory over each step
    stacked by category, the budget and the card's memory as lines, each peak marked with what holds it. None if
    matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return None
    cols = -(-len(panels) // rows)
    fig, grid = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows + 0.6), sharey=True, squeeze=False)
    axes = [[grid[i % rows][i // rows] for i in range(len(panels))]]  # column by column: measured above predicted
    every = [timeline(snap) for _, snap in panels]
    high = max(max(sum(s[c][i] for c in s) for i in range(len(s[RESERVED]))) for s in every) * 1.25
    if budget and budget <= 4 * high:  # a budget far above the step is named, not drawn: the step keeps the scale
        high = max(high, budget * 1.05)
    unit, scale = ("GiB", 2**30) if high >= 2**30 else ("MiB", 2**20)  # a small step's figures not all 0.00 GiB
    for ax, (label, _), series in zip(axes[0], panels, every):
        names = [c for c in (*CATEGORIES, RESERVED) if any(series[c])]
        x = range(len(series[CATEGORIES[0]]))
        ax.stackplot(x, [[v / scale for v in series[c]] for c in names], labels=names, linewidth=0,
                     colors=[COLORS[c] for c in names])
        at, held = peak_of(series)
        top = sum(v for c, v in held.items() if c != RESERVED)
        ax.plot([at], [top / scale], "kv")
        big = sorted(((v, c) for c, v in held.items() if c != RESERVED), reverse=True)[:3]
        if GATHERED in held and all(c != GATHERED for _, c in big):  # named wherever it is part of the peak
            big.append((held[GATHERED], GATHERED))
        ax.annotate(f"peak {top / scale:.2f} {unit}\n" + "\n".join(f"{c} {v / scale:.2f}" for v, c in big), (at, top / scale),
                    textcoords="offset points", xytext=(-10, 8), ha="right", fontsize=7)
        above = []
        for value, name, style in ((budget, "budget", "--"), (card, "card", ":")):
            if value and value <= high:
                ax.axhline(value / scale, color="k", linestyle=style, linewidth=1)
                ax.text(0, value / scale, f" {name} {format_bytes(value)}", va="bottom", fontsize=7)
            elif value:  # far above the step: named, not drawn, so that the step keeps the scale
                above.append(f"{name} {format_bytes(value)}")
        if above:
            ax.text(0, high / scale, f" {', '.join(above)} (above)", va="top", fontsize=7)
        ax.set_ylim(0, high / scale)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("allocations and frees, in order", fontsize=7)
    for row in grid:
        row[0].set_ylabel(unit)
    grid[0][-1].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    return _save(plt, fig, path)


def draw_stages(traces: list[tuple[str, list[int]]], path: str | Path, budget: int | None = None,
                card: int | None = None, title: str = "") -> Path | None:
    """A pipeline step's memory, one line a rank (``traces``: its label and its bytes alive over its step, allocation
    by allocation), each rank's step stretched over the same width: the ranks' steps run side by side, but their
    allocations are counted, not timed, so the picture compares heights and shapes, not moments. The budget and the
    card as lines. None if matplotlib is missing."""
    plt = _pyplot(path)
    if plt is None:
        return None
    high = max(max(t) for _, t in traces) * 1.15
    if budget and budget <= 4 * high:
        high = max(high, budget * 1.05)
    unit, scale = ("GiB", 2**30) if high >= 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for label, trace in traces:
        x = [i / max(len(trace) - 1, 1) for i in range(len(trace))]
        line, = ax.plot(x, [v / scale for v in trace], linewidth=1.2, label=f"{label}: peak {max(trace) / scale:.2f} {unit}")
        at = max(range(len(trace)), key=trace.__getitem__)
        ax.plot([x[at]], [trace[at] / scale], "v", color=line.get_color())
    for value, name, style in ((budget, "budget", "--"), (card, "card", ":")):
        if value and value <= high:
            ax.axhline(value / scale, color="k", linestyle=style, linewidth=1)
            ax.text(0, value / scale, f" {name} {format_bytes(value)}", va="bottom", fontsize=7)
    ax.set_ylim(0, high / scale)
    ax.set_ylabel(unit)
    ax.set_xlabel("each rank's step, its allocations and frees in order (start to end)", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    fig.suptitle(textwrap.fill(title, 130), fontsize=8)
    return _save(plt, fig, path)


def _pyplot(path: str | Path):
    """matplotlib's pyplot on its file-only backend; None (with a warning naming ``path``) where it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no %s", path)
        return None
    return plt


def _save(plt, fig, path: str | Path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
