"""A pipeline rank's step put together, allocation by allocation, from a small step of the same rank: the trainer's
step run on fake ranks with three blocks a stage and as few micro-batches as show every kind of action the real
schedule runs on this rank, recorded with a mark where each action (a micro-batch's forward or backward of a stage)
and each block begins. A 405B rank's step (32 micro-batches through 16 blocks) is a few minutes of fake dispatch;
the small step is seconds.

Why the whole is its parts: a stage's blocks are identical, so a block between the first and the last allocates and
frees as every other between them does (the first and last differ: the stage's edges, FSDP's prefetch); an action
allocates and frees as every action of its kind does, its kind being its stage, forward or backward, whether its
micro-batch is the first or the last (the gradients made, FSDP's reduction), the actions beside it (what a schedule
waits on and lets go of around it) and under 1F1B a warm-up micro-batch's own place. So the real step is its actions
in the real schedule's order, each the small step's action of its kind with its middle block repeated as often as
the stage has blocks between its first and last; what the schedule lets go of together at its end (a loss, a send
each micro-batch) as many more times as the real step has micro-batches more. What follows the schedule (the
gradients' norm, the optimizer's step) depends on every parameter's shape: it is run whole, on the real rank's
parameters, given gradients of their shapes.

Checked on the small step itself, else the whole step is run (``NotComposable``): the actions came in the order
predicted for it, every action of one kind recorded alike (the small step has two of every kind the real step repeats),
the recorded allocations add up to its peak. Under FSDP the interleaved schedule gathers both of a rank's stages'
weights ahead, all their blocks at once, at the step's start, and waits on a stage's before its first action: those
gathers are marked as their blocks' (a middle one repeated as the real stage's), and the action before a stage's
first is a kind of its own. `tests/test_pipeline_compose.py` holds the composed plan to the whole step's, allocation
by allocation, over the schedules, policies and layouts.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
from dataclasses import dataclass

from fitgpt.config import STAGES_PER_RANK, TrainConfig
from fitgpt.estimate.pipeline_marks import Mark, Recorder
from fitgpt.parallel.stages import stage_blocks

SMALL_BLOCKS = 3
"""Blocks a stage in the small step: its first, one of those between, its last."""


class NotComposable(Exception):
    """The small step does not show the real one's parts: the real step is run whole."""


def action_order(schedule: str, pp: int, rank: int, microbatches: int) -> list[tuple[str, int, int]]:
    """The actions ("F" or "B", stage, micro-batch) rank ``rank`` of ``pp`` runs in a step, in the order PyTorch's
    schedule runs them (checked against the small step's, where it is wrong the plan runs the step whole)."""
    if schedule == "gpipe":
        return [("F", rank, m) for m in range(microbatches)] + [("B", rank, m) for m in range(microbatches)]
    if schedule == "1f1b":  # Schedule1F1B: P - s forwards, then a backward and a forward in turn, then the backwards
        warmup = min(microbatches, pp - rank)
        order, f, b = [("F", rank, m) for m in range(warmup)], warmup, 0
        while b < microbatches:
            order.append(("B", rank, b))
            b += 1
            if f < microbatches:
                order.append(("F", rank, f))
                f += 1
        return order
    return _interleaved_order(pp, rank, STAGES_PER_RANK[schedule], microbatches)


def _interleaved_order(pp: int, rank: int, per_rank: int, microbatches: int) -> list[tuple[str, int, int]]:
    """ScheduleInterleaved1F1B's own table for ``rank``, computed without its stages."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    table = object.__new__(ScheduleInterleaved1F1B)  # only what the table's computation reads
    rounds = max(1, microbatches // pp)
    table.pp_group_size, table.n_local_stages, table._n_microbatches = pp, per_rank, microbatches
    table.number_of_rounds, table.microbatches_per_round, table.rank = rounds, microbatches // rounds, rank
    table._num_stages = pp * per_rank
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    return [(kinds[a.computation_type], a.stage_index, a.microbatch_index)
            for a in table._calculate_single_rank_operations(rank) if a is not None and a.computation_type in kinds]


def _kinds(order: list[tuple[str, int, int]], microbatches: int, cfg: TrainConfig) -> list[tuple]:
    """Each action's kind: forward or backward, its stage's role, first or last micro-batch, and what ran before and after it
    where what it allocates depends on that. GPipe's and 1F1B's sends are waited on and let go of around the next
    action: there, the actions beside it on the rank. FSDP leaves a stage's weights gathered or not by what that stage
    ran last (PyTorch's schedules reshard a stage's blocks after a forward and not after a backward, the root after
    neither, until its gradients are reduced): under the interleaved schedule, whose rank runs two stages, the kind of
    the stage's own last action (none before its first), whether the next action is a stage's first (the schedule
    waits there on that stage's weights, gathered ahead), and no more: its sends are waited on at the step's end, and
    its last forward allocates as any other. Under 1F1B a micro-batch of the warm-up is its own kind: the schedule
    holds the work of the warm-up's last send but one until its cool-down begins, so that micro-batch's output is let
    go of at a place of its own."""
    schedule = cfg.pipeline_schedule
    window = next((i for i, a in enumerate(order) if a[0] == "B"), 0) if schedule == "1f1b" else 0
    beside = schedule != "interleaved-1f1b"
    by_stage = schedule == "interleaved-1f1b" and cfg.parallel == "fsdp"
    firsts = {next(i for i, a in enumerate(order) if a[1] == s) for s in {a[1] for a in order}}
    role = functools.partial(_role, cfg)
    out, last = [], {}
    for i, (k, s, m) in enumerate(order):
        before = (order[i - 1][0], role(order[i - 1][1])) if i and beside else last.get(s) if by_stage else None
        after = (order[i + 1][0], role(order[i + 1][1])) if i + 1 < len(order) and beside else None
        if by_stage and i + 1 in firsts:  # the schedule waits on the next stage's weights, gathered ahead, here
            after = role(order[i + 1][1])
        last_one = m == microbatches - 1 and (k == "B" or beside)  # interleaved: a last forward is as any other
        out.append((k, role(s), m if m < window else None, m == 0, last_one, before, after))
        last[s] = k
    return out


def _role(cfg: TrainConfig, stage: int) -> tuple[str, int]:
    """A stage as an action's kind knows it: the first (the embedding), the last (the head, the loss) or one between,
    and which of its rank's stages it is. Two ranks' stages of one role allocate alike where they have as many blocks
    (in the small step every stage has three)."""
    last = cfg.pipeline_parallel * STAGES_PER_RANK[cfg.pipeline_schedule] - 1
    return ("first" if stage == 0 else "last" if stage == last else "between", stage // cfg.pipeline_parallel)


def _stage_sizes(cfg: TrainConfig) -> list[int]:
    """Each stage's number of blocks under ``cfg``'s pipeline."""
    n_stages = cfg.pipeline_parallel * STAGES_PER_RANK[cfg.pipeline_schedule]
    return [len(r) for r in stage_blocks(cfg.model.n_blocks, n_stages)]


def _kind_counts(cfg: TrainConfig, rank: int, microbatches: int) -> collections.Counter:
    order = action_order(cfg.pipeline_schedule, cfg.pipeline_parallel, rank, microbatches)
    return collections.Counter(_kinds(order, microbatches, cfg))


def _small_blocks(cfg: TrainConfig) -> int:
    """Blocks in the small step: three a stage where every stage has two or more and one more than three."""
    sizes = _stage_sizes(cfg)
    return len(sizes) * SMALL_BLOCKS if min(sizes) >= 2 and max(sizes) > SMALL_BLOCKS else cfg.model.n_blocks


def small_config(cfg: TrainConfig, pp_rank: int, serves: tuple[int, ...] | None = None) -> TrainConfig | None:
    """The small step's config for rank ``pp_rank`` of ``cfg``'s pipeline: three blocks a stage (where every stage has
    two or more), the same micro-batches (rows each) but as few as show every kind of action of each rank it
    ``serves`` (default: itself); None where that is no smaller."""
    pp, schedule, m = cfg.pipeline_parallel, cfg.pipeline_schedule, cfg.microbatches
    blocks = _small_blocks(cfg)
    wanted = collections.Counter()
    for r in serves or (pp_rank,):
        wanted |= _kind_counts(cfg, r, m)  # the most of each kind
    step = pp if schedule == "interleaved-1f1b" else 1  # interleaved: whole rounds of P
    small_m = next(k for k in itertools.count(max(step, pp if schedule == "1f1b" else 2), step)
                   if k >= m or _shows(_kind_counts(cfg, pp_rank, k), wanted))
    if small_m >= m and blocks == cfg.model.n_blocks:
        return None
    small_m = min(small_m, m)
    rows = cfg.batch_size // m
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_blocks=blocks), batch_size=rows * small_m,
                               pipeline_microbatches=small_m)


def stand_ins(cfg: TrainConfig, ranks: list[int]) -> dict[int, int]:
    """For each of ``ranks``, the rank whose small step it is composed from: itself, but under the interleaved schedule
    a rank whose stages are all between the first and the last may be composed from another such rank's, whose small
    step shows every kind of action it runs (its kinds know a stage by its role, and in the small step every stage has
    three blocks). 1F1B's and GPipe's ranks hold a warm-up of their own: each is its own."""
    out = {r: r for r in ranks}
    if cfg.pipeline_schedule != "interleaved-1f1b" or _small_blocks(cfg) == cfg.model.n_blocks:
        return out
    per = STAGES_PER_RANK[cfg.pipeline_schedule]
    between = [r for r in ranks if all(_role(cfg, r + i * cfg.pipeline_parallel)[0] == "between" for i in range(per))]
    real = {r: _kind_counts(cfg, r, cfg.microbatches) for r in between}
    shown = {c: _kind_counts(cfg, c, (small_config(cfg, c) or cfg).microbatches) for c in between}
    while between:  # the rank whose own small step serves the most of those left
        served = {c: [r for r in between if _shows(shown[c], real[r])] for c in between}
        c = max(between, key=lambda r: len(served[r]))
        for r in served[c]:
            out[r] = c
        between = [r for r in between if r not in served[c]]
    return out


def _shows(small: collections.Counter, real: collections.Counter) -> bool:
    """Whether a small step of ``small`` kinds of action shows every kind of ``real``'s, twice where the real step has
    it twice or more (so that the check that every action of a kind is alike has two to compare)."""
    return all(small[kind] >= min(n, 2) for kind, n in real.items())


@dataclass
class Recorded:
    """The small step as recorded: its actions' tokens by kind, how many blocks it gave each stage, and its last
    action's frees' births."""

    rank: int
    """The pipeline rank whose small step it is."""
    head: list
    by_kind: dict
    blocks: int
    """Blocks a stage in the small step (every stage the same)."""
    microbatches: int
    last_births: list
    """For each token of the last action, the action its storage was made in where it is a free, else None."""


def parse(rec: Recorder, cfg: TrainConfig, pp_rank: int) -> Recorded:
    """The small step's recording (``cfg``: its config) cut into actions, checked as the module says."""
    head, actions = [], []
    current, births, last_births = head, [], []
    for i, t in enumerate(rec.tokens):
        if isinstance(t, Mark) and t.kind in ("F", "B"):
            actions.append(((t.kind, t.stage, t.index), []))
            current, births = actions[-1][1], []
        elif isinstance(t, Mark) and t.kind == "end":
            last_births, current, births = births, [], []  # what follows the schedule: run whole on the real rank
        elif t != 0:  # 0: made before, as ``Recorder.unmade`` counts it
            current.append(t)
            births.append(rec.births.get(i))
    m = cfg.microbatches
    order = [a for a, _ in actions]
    if order != action_order(cfg.pipeline_schedule, cfg.pipeline_parallel, pp_rank, m):
        raise NotComposable("the schedule ran its actions in another order than predicted")
    blocks = _stage_sizes(cfg)[0]  # the small step's stages are all alike
    by_kind: dict = {}
    for kind, (_, chunk) in zip(_kinds(order, m, cfg), actions):
        if by_kind.setdefault(kind, chunk) != chunk:
            raise NotComposable(f"two actions of one kind ({kind}) allocated differently")
    return Recorded(rank=pp_rank, head=head, by_kind=by_kind, blocks=blocks, microbatches=m, last_births=last_births)


def expand(chunk: list, blocks, small_blocks: int) -> list[int]:
    """An action's allocations with each stage's middle block repeated: ``blocks`` blocks a stage (a number, or one per
    stage) where the small step had ``small_blocks`` (the same number: as recorded, marks dropped). What falls between
    one block's marks and the next block's is that block's (its forward, its backward, FSDP's reduction of its
    gradients, the schedule's gathering of its weights); a block between the first and the last stands for each of the
    real stage's between them, wherever in the action it comes."""
    size = (lambda stage: blocks) if isinstance(blocks, int) else blocks.__getitem__
    pre, groups = [], []
    for t in chunk:
        if isinstance(t, Mark):
            if not groups or groups[-1][0] != (t.stage, t.index):
                groups.append(((t.stage, t.index), []))
        else:
            (groups[-1][1] if groups else pre).append(t)
    out = pre
    for (stage, j), g in groups:
        out = out + g * (size(stage) - small_blocks + 1) if 0 < j < small_blocks - 1 else out + g
    return out


def compose(rec: Recorded, cfg: TrainConfig, pp_rank: int) -> list[int]:
    """The real step's allocations and frees up to the schedule's end (``cfg``: the real config), from ``rec``: the
    small step of this rank, or of the rank that stands in for it (`stand_ins`)."""
    m, pp = cfg.microbatches, cfg.pipeline_parallel
    order = action_order(cfg.pipeline_schedule, pp, pp_rank, m)
    # The recorded rank's marks name its own stages: each stands for this rank's stage of the same place on its rank.
    real = _stage_sizes(cfg)
    sizes = {s: real[pp_rank + s - rec.rank] for s in range(rec.rank, len(real), pp)}
    out = expand(rec.head, sizes, rec.blocks)
    kinds = _kinds(order, m, cfg)
    for i, kind in enumerate(kinds):
        if kind not in rec.by_kind:
            raise NotComposable(f"the small step ran no action of the kind {kind}")
        chunk = rec.by_kind[kind]
        if i == len(order) - 1:
            chunk = let_go_together(chunk, rec.last_births, m - rec.microbatches)
        out += expand(chunk, sizes, rec.blocks)
    return out


def let_go_together(chunk: list, births: list, more: int) -> list:
    """The last action's ``chunk`` with ``more`` micro-batches' more of what the schedule lets go together at its
    step's end: a run of frees of one size, of storages made by the actions of one or more kinds (a stage's forward,
    or its backward), each kind's made by micro-batches one after another from the first (PyTorch's
    schedules keep every micro-batch's loss, and GPipe's and the interleaved schedule's every send, until then). Each
    such kind lets go of ``more`` more in the real step; where in the run they go changes nothing (one size)."""
    if more <= 0:
        return chunk
    out, i = [], 0
    while i < len(chunk):
        j = i
        while j < len(chunk) and isinstance(chunk[j], int) and chunk[j] == chunk[i] < 0 and births[j] is not None:
            j += 1
        if j - i < 2:
            out.append(chunk[i])
            i += 1
            continue
        made: dict = {}
        for k in range(i, j):
            made.setdefault(births[k][:2], set()).add(births[k][2])
        scaled = sum(1 for mbs in made.values() if len(mbs) >= 2 and min(mbs) == 0 and max(mbs) == len(mbs) - 1)
        out += chunk[i:j] + [chunk[i]] * (more * scaled)
        i = j
    return out


def tail(tokens: list) -> list[int]:
    """What follows the schedule's end."""
    ends = [i for i, t in enumerate(tokens) if isinstance(t, Mark) and t.kind == "end"]
    return [t for t in tokens[ends[-1] + 1:] if not isinstance(t, Mark)] if ends else []


def levels(deltas: list[int], start: int = 0) -> list[int]:
    """The bytes alive after each allocation and free, from ``start``."""
    return list(itertools.accumulate(deltas, initial=start))
