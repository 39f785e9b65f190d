"""``fit --largest-model --search-pipeline``: the largest model of the family each pipeline layout of the ranks
trains, beside FSDP's rows (issue 69).

For each pipeline degree P that divides the ranks (each stage sharded by FSDP over the other world / P ranks where
there are several), the schedule that holds least: 1F1B where the step's batch gives each stage a micro-batch of
its own (one-row micro-batches, at most P in flight), else GPipe. Each optimizer setting of the ladder the stages can
train (a step in the backward cannot run inside PyTorch's schedules: those rows stay FSDP's) is searched over depths
as `fitgpt.plan.family` searches them, every pipeline rank planned (`fitgpt.estimate.pipeline`): a depth fits when
some checkpointing policy keeps every rank's peak within the budget. At the largest depth the row takes the least
recomputing policy that fits every rank, and its time is the unpipelined step's shared among the stages, plus the
bubble (`pipeline_step_time`)."""

from __future__ import annotations

import dataclasses

from fitgpt.config import STAGES_PER_RANK
from fitgpt.estimate.pipeline import pipeline_step_time
from fitgpt.estimate.profile import BLOCK_OPTIONS
from fitgpt.estimate.source import OwnModel, param_count
from fitgpt.estimate.workload import Workload
from fitgpt.parallel.pipeline import pipeline_refusal
from fitgpt.plan import family
from fitgpt.plan.family import Largest, first_guess, rung_settings, scaled, walk_depths
from fitgpt.plan.fastest import Layout
from fitgpt.plan.solver import Plan, predict
from fitgpt.utils import in_processes

FIT_ORDER = ("block", "selective", "pointwise", "none")
"""The order a depth's policies are tried in to see whether any fits: the one that usually holds least first (not
always the least: every policy is tried at a depth none fits, so none is missed)."""


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
            model, optim = rung_settings(w, changes)
            staged = w.vary(model=model, optim=optim, grad_accum=1, **layout.settings())
            if launch_refusal(staged.train, w.world_size, w.target.device, None, planned=True) is None:
                jobs.append((staged, budget, f"{name}; {layout_name(layout, w.world_size)}", layout))
    return in_processes(_largest_layout, jobs, workers)


def _largest_layout(w: Workload, budget: int, name: str, layout: Layout) -> Largest:
    base, tp = w.train.model, w.train.tensor_parallel
    lowest: dict[int, int] = {}  # each probed depth's least peak among the policies tried
    peaks: dict[tuple[int, str], list] = {}  # (depth, policy) -> each rank's plan

    def ranks(n: int, policy: str) -> list:
        if (n, policy) not in peaks:
            peaks[n, policy] = w.vary(model=scaled(base, n, tp)).stages(policy)
        return peaks[n, policy]

    def fits(n: int, policy: str) -> bool:
        peak = max(s.peak for s in ranks(n, policy))
        lowest[n] = min(lowest.get(n, peak), peak)
        return peak <= budget

    def probe(n: int) -> bool:  # does any policy fit every rank? (all are tried where none does)
        return any(fits(n, policy) for policy in FIT_ORDER)

    stages = layout.pp * STAGES_PER_RANK[layout.schedule]  # a block a stage at least
    # Where the state alone, split over every rank, would fill each rank's budget: an upper bound to start from
    first = max(stages, first_guess(base, budget * w.world_size, w.train.optim, None, tp))
    lo = walk_depths(first, probe, lowest, budget, floor=stages - 1)
    if lo < stages:
        return Largest(name, w.train.optim, None, profiles=len(peaks), note="not even a block a stage fits")
    policy = next(p for p in BLOCK_OPTIONS if fits(lo, p))  # the least recomputing that fits every rank
    model = scaled(base, lo, tp)
    whole = w.vary(model=model).unpipelined().profile()  # its time: the step of one rank holding every block
    plan = Plan.profiled(policy, whole)[0]
    top, unpiped = max(ranks(lo, policy), key=lambda s: s.peak), predict(whole, plan)
    seconds = pipeline_step_time(unpiped.step_time, layout.pp, layout.schedule, layout.microbatches)
    # The largest rank's bytes; the whole step's FLOPs, which the stages share
    prediction = dataclasses.replace(unpiped, peak=top.peak, where=f"pipeline rank {top.rank}", params=top.params,
                                     optimizer=top.optimizer, grads=top.grads, activations=top.activations,
                                     temporaries=0, activations_end_of_forward=0, step_time=seconds)
    return Largest(name, w.train.optim, model, param_count(OwnModel(model)), plan, prediction, len(peaks) + 1,
                   tokens=w.train.batch_size * w.context, precision=w.train.precision,
                   settings=tuple(layout.settings().items()))
