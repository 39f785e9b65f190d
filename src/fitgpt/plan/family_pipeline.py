"""``fit --largest-model --search-pipeline``: the largest model of the family each pipeline layout of the ranks
trains, beside FSDP's rows (issue 69).

For each pipeline degree P that divides the ranks (each stage sharded by FSDP over the other world / P ranks where
there are several), the schedule that holds least: 1F1B where the step's batch gives each stage a micro-batch of
its own (one-row micro-batches, at most P in flight), else GPipe. Each optimizer setting of the ladder the stages can
train (a step in the backward cannot run inside PyTorch's schedules: those rows stay FSDP's) is searched over depths
as `fitgpt.plan.family` searches them, every pipeline rank planned (`fitgpt.estimate.pipeline`): a depth fits when
every rank's peak under full block checkpointing, the least a rank holds, is within the budget. At the largest depth
the row takes the least recomputing policy that fits every rank, and its time is the unpipelined step's shared among
the stages, plus the bubble (`pipeline_step_time`)."""

from __future__ import annotations

import dataclasses

from fitgpt.config import STAGES_PER_RANK
from fitgpt.estimate.pipeline import pipeline_step_time
from fitgpt.estimate.profile import BLOCK_OPTIONS
from fitgpt.estimate.source import OwnModel, param_count
from fitgpt.estimate.workload import Workload
from fitgpt.parallel.pipeline import pipeline_refusal
from fitgpt.plan import family
from fitgpt.plan.family import MODEL_SETTINGS, Largest, first_guess, scaled, walk_depths
from fitgpt.plan.fastest import Layout
from fitgpt.plan.solver import Plan, predict
from fitgpt.utils import in_processes

LEAST_HELD = "block"
"""The policy a depth is judged by: every block recomputed, the least a pipeline rank holds."""


def least_held_layouts(w: Workload) -> list[Layout]:
    """Each pipeline degree of ``w``'s ranks with the schedule that holds least at ``w``'s batch."""
    seqs, tp, out = w.train.batch_size, w.train.tensor_parallel, []
    for pp in (d for d in range(2, w.world_size // tp + 1) if (w.world_size // tp) % d == 0):
        for schedule, m in (("1f1b", seqs), ("gpipe", seqs)):
            if pipeline_refusal(pp * STAGES_PER_RANK[schedule], pp, schedule, m, seqs) is None:
                out.append(Layout("fsdp" if w.world_size > pp * tp else "pp", tp=tp, pp=pp, schedule=schedule,
                                  microbatches=m))
                break
    return out


def layout_name(layout: Layout, world: int) -> str:
    """How a row names its layout: ``PP 2 x FSDP 4, 1F1B``."""
    dp = world // layout.pp // layout.tp
    return (f"PP {layout.pp}" + (f" x FSDP {dp}" if dp > 1 else "") + (f" x TP {layout.tp}" if layout.tp > 1 else "")
            + f", {layout.schedule.upper() if layout.schedule == '1f1b' else 'GPipe'}")


def largest_pipelined(w: Workload, budget: int, ladder: tuple[tuple[str, dict], ...] | None = None,
                      workers: int | None = None) -> list[Largest]:
    """A row for each pipeline layout (`least_held_layouts`) and each setting of ``ladder`` (default: ``LADDER``) its
    stages can train: the largest depth every pipeline rank fits within ``budget``, with its plan."""
    from fitgpt.refusals import launch_refusal

    jobs = []
    for layout in least_held_layouts(w):
        for name, changes in ladder or family.LADDER:
            optim = dataclasses.replace(w.train.optim, **{k: v for k, v in changes.items() if k not in MODEL_SETTINGS})
            model = dataclasses.replace(w.train.model, **{k: v for k, v in changes.items() if k in MODEL_SETTINGS})
            train = dataclasses.replace(w.train, model=model, optim=optim, grad_accum=1, **layout.settings())
            if launch_refusal(train, w.world_size, w.target.device, None, planned=True) is None:
                jobs.append((w.vary(model=model, optim=optim, grad_accum=1, **layout.settings()), budget,
                             f"{name}; {layout_name(layout, w.world_size)}", layout))
    return in_processes(_largest_layout, jobs, workers)


def _largest_layout(w: Workload, budget: int, name: str, layout: Layout) -> Largest:
    base, tp = w.train.model, w.train.tensor_parallel
    lowest: dict[int, int] = {}
    held: dict[int, list] = {}  # each probed depth's ranks under LEAST_HELD
    plans = [0]  # every rank planned once, for the row's count

    def at(n: int) -> Workload:
        return w.vary(model=scaled(base, n, tp))

    def planned(n: int, policy: str) -> list:
        plans[0] += 1
        return at(n).stages(policy)

    def probe(n: int) -> bool:
        held[n] = planned(n, LEAST_HELD)
        lowest[n] = max(s.peak for s in held[n])
        return lowest[n] <= budget

    stages = layout.pp * STAGES_PER_RANK[layout.schedule]  # a block a stage at least
    # Where the state alone, split over every rank, would fill each rank's budget: an upper bound to start from
    first = max(stages, first_guess(base, budget * w.world_size, w.train.optim, None, tp))
    lo = walk_depths(first, probe, lowest, budget, floor=stages - 1)
    if lo < stages:
        return Largest(name, w.train.optim, None, profiles=plans[0], note="not even a block a stage fits")
    for policy in BLOCK_OPTIONS:  # the least recomputing that fits every rank (LEAST_HELD does, the last)
        ranks = held[lo] if policy == LEAST_HELD else planned(lo, policy)
        if max(s.peak for s in ranks) <= budget:
            break
    whole = at(lo).unpipelined().profile()  # its time: the step of one rank holding every block
    plan = Plan.profiled(policy, whole)[0]
    top, unpiped = max(ranks, key=lambda s: s.peak), predict(whole, plan)
    seconds = pipeline_step_time(unpiped.step_time, layout.pp, layout.schedule, layout.microbatches)
    # The largest rank's bytes; the whole step's FLOPs, which the stages share
    prediction = dataclasses.replace(unpiped, peak=top.peak, where=f"pipeline rank {top.rank}", params=top.params,
                                     optimizer=top.optimizer, grads=top.grads, activations=top.activations,
                                     temporaries=0, activations_end_of_forward=0, step_time=seconds)
    model = scaled(base, lo, tp)
    return Largest(name, w.train.optim, model, param_count(OwnModel(model)), plan, prediction, plans[0] + 1,
                   tokens=w.train.batch_size * w.context, precision=w.train.precision,
                   settings=tuple(layout.settings().items()))
