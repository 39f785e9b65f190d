"""fit's pipeline layouts (``fit --search-pipeline``): each pipeline degree P that divides --world-size (FSDP over the
other world / P ranks of each stage), each schedule, the step's whole batch cut into one-row micro-batches where the
schedule takes that many (the smallest bubble), else P; each with the least recomputing policy that fits every rank
(`fitgpt.estimate.pipeline`: every rank planned), timed as one rank holding every block shares its time among the
stages, plus the bubble, plus the sends and FSDP's gathers the schedule cannot hide (estimated from link bandwidths)."""

from __future__ import annotations

import dataclasses

from fitgpt.estimate.pipeline import pipeline_step_time
from fitgpt.estimate.profile import BLOCK_OPTIONS
from fitgpt.parallel.pipeline import pipeline_refusal
from fitgpt.plan.fastest import GLOO_LINK, Choice, Layout, _link_seconds, layout_refusal
from fitgpt.plan.solver import Plan, predict

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def pipeline_layouts(w, seqs: int) -> list[Layout]:
    """The pipeline layouts the trainer would launch for ``w``'s ranks, a step of ``seqs`` sequences a pipeline."""
    if w.source is not None or w.world_size < 2:  # fitgpt's own model, under torchrun
        return []
    out = []
    for pp in (d for d in range(2, w.world_size + 1) if w.world_size % d == 0):
        for schedule in SCHEDULES:
            fits = [m for m in (seqs, pp) if seqs % m == 0
                    and pipeline_refusal(w.train.model.n_blocks, pp, schedule, m, seqs) is None]
            if not fits:
                continue
            layout = Layout("fsdp" if w.world_size > pp else "pp", pp=pp, schedule=schedule, microbatches=fits[0])
            if layout_refusal(w, layout) is None:
                out.append(layout)
    return out


def pipeline_choices(search, seqs: int, precisions: list[str]) -> tuple[list[Choice], int]:
    """Each pipeline layout's choice at each precision (those where some policy fits every rank), and the profiles
    taken: one a precision and data-parallel degree, of the step unpipelined, for its time."""
    out, wholes = [], {}
    for precision in precisions:
        for layout in pipeline_layouts(search.w, seqs):
            w = search.w.vary(precision=precision, batch_size=seqs, grad_accum=1, cost=search.costs[precision],
                              **layout.settings())
            key = (precision, w.world_size // layout.pp)
            if key not in wholes:  # the unpipelined step's time: the same for each schedule of a degree
                wholes[key] = w.unpipelined().profile(extra_options=search.named)
            if c := _choice(search, w, wholes[key], precision, layout, seqs):
                out.append(c)
    return out, len(wholes)


def _choice(search, w, whole, precision: str, layout: Layout, seqs: int) -> Choice | None:
    """The least recomputing policy (or the one given) whose every rank fits, as a Choice; None if none fits."""
    for policy in [search.given] if search.given else BLOCK_OPTIONS:
        peak = max(s.peak for s in w.stages(policy))
        if peak > search.budget:
            continue
        plan = Plan.profiled(policy, whole)[0]
        seconds = pipeline_step_time(predict(whole, plan).step_time, layout.pp, layout.schedule, layout.microbatches)
        return Choice(seqs, 1, precision, layout, plan, peak, seconds, _link(w, layout, seconds, seqs, search.params),
                      search.tokens // layout.pp, True, policy)
    return None


def _link(w, layout: Layout, seconds: float, seqs: int, params: int) -> float:
    """Seconds of communication a pipeline step cannot hide (estimated): the sends of the pipeline's filling and
    draining, a micro-batch's hidden states forward and their gradients back across each of the P - 1 links, and,
    sharded, FSDP's gathers and reduce-scatters of the stage's weights at each micro-batch."""
    t, m = w.target, layout.microbatches
    peer = (t.gpu.peer_link if t.gpu else 32e9) if t.cuda else GLOO_LINK
    dtype_bytes = 2 if w.dtype is not None else 4
    hidden = seqs // m * w.context * w.train.model.n_embed * dtype_bytes
    sends = 2 * (layout.pp - 1) * hidden / peer
    if layout.parallel != "fsdp":
        return sends
    stage = dataclasses.replace(layout, pp=1)  # a stage's FSDP over its data-parallel ranks, each micro-batch
    per_rank = dataclasses.replace(w, world_size=w.world_size // layout.pp)
    return sends + _link_seconds(per_rank, stage, m, seconds / m, params // layout.pp, dtype_bytes, seqs // m)
