"""A pipeline's memory, planned per rank: each stage's rank runs the trainer's own pipeline step (its stages,
checkpointed and sharded as the trainer does them, run by the same PyTorch schedule) on fake tensors, as that rank of
a fake process group, and its peak is read as the trainer's probe reads a real one.

No model of a schedule is trusted here: what a schedule holds depends on the order it runs the micro-batches in
(GPipe every forward first, 1F1B at most P - s in flight on stage s, interleaved its own table), the receive buffers it
keeps for every micro-batch, the sends whose work holds a stage's output to the step's end, and the head on the last
stage only. Running the schedule gives all of them. A large rank's step (many blocks, many micro-batches) is put
together from a small step of the same rank (under the interleaved schedule, of a rank whose stages play the same
roles), allocation by allocation (`fitgpt.estimate.pipeline_compose`, which says why that is exact and checks it),
else run whole. A stage's data-parallel ranks (FSDP's) hold the same shapes, so the
first of them stands for all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from fitgpt.config import STAGES_PER_RANK, TrainConfig
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.ranks import fake_ranks, in_own_process
from fitgpt.utils import Forked

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageRank:
    """One pipeline rank's plan: its stages' blocks and the bytes it holds at its step's peak."""

    rank: int
    """The rank's place in the pipeline (0: the first stage's)."""
    blocks: tuple[tuple[int, int], ...]
    """Each of its stages' blocks, (first, last)."""
    peak: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    """The receive buffers the schedule keeps for every micro-batch (activations in, their gradients back)."""
    seconds: float = 0.0
    """How long planning it took."""
    composed: bool = False
    """Put together from a small step of the rank (`fitgpt.estimate.pipeline_compose`), not run whole."""
    trace: tuple[int, ...] = ()
    """Bytes alive over its step, allocation by allocation (at most ``TRACE_POINTS``, each the most of its stretch,
    so that no peak is lost): what ``plan --report`` draws."""

    @property
    def activations(self) -> int:
        """What the step adds over what is held across steps: activations in flight, sends held, temporaries."""
        return self.peak - self.params - self.grads - self.optimizer - self.buffers

    def describe_blocks(self) -> str:
        return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in self.blocks)


COMPOSED = ("gpipe", "1f1b", "interleaved-1f1b")
"""The schedules whose large steps are put together from a small one (`fitgpt.estimate.pipeline_compose` knows their
orders of actions, and FSDP's weights gathered and freed by them); the zero-bubble schedules' steps are run whole, and
so is any step whose FSDP keeps its weights gathered after the forward."""

TRACE_POINTS = 600


def thinned(points: list[int], most: int | None = None) -> tuple[int, ...]:
    """At most ``most`` (default ``TRACE_POINTS``) of ``points``, each the largest of its stretch of the step (no peak
    lost)."""
    most, n = most or TRACE_POINTS, len(points)
    if n <= most:
        return tuple(points)
    return tuple(max(points[i * n // most:(i + 1) * n // most]) for i in range(most))


def bubble(pp: int, schedule: str, microbatches: int) -> float:
    """The fraction of a step each rank waits (the pipeline filling and draining): (P - 1) / (v M + P - 1), v the
    stages a rank holds (interleaving shrinks each stage's time by v), M the micro-batches (Narayanan et al. 2021).
    The zero-bubble schedules are given interleaved 1F1B's: what they fill of it depends on the weights' gradients'
    share of the backward, not timed here, so the figure is an upper bound."""
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


def pipeline_step_time(whole: float, pp: int, schedule: str, microbatches: int) -> float:
    """A step's seconds under the pipeline, from ``whole``: the same batch's forward, backward and step on one rank
    holding every block. Each rank computes 1/P of it, and waits the bubble besides (the sends are not timed)."""
    return whole / pp / (1 - bubble(pp, schedule, microbatches))


def plan_pipeline(cfg: TrainConfig, world: int, dtype: torch.dtype | None = None, device: str = "cpu",
                  target: Target | None = None, ranks: list[int] | None = None, whole: bool = False) -> list[StageRank]:
    """Each pipeline rank's plan (or those of ``ranks``) for ``cfg`` (--pipeline-parallel, its schedule, micro-batches,
    checkpointing policy and optimizer) over ``world`` processes, training in ``dtype`` (autocast's, or under FSDP the
    gathered weights'; None: fp32) on ``target`` (a CUDA card: its allocator's 512-byte blocks and CUDA autocast's
    dtypes; by default the device itself). ``whole``: every rank's whole step run, none composed (slower; the same
    plan, which the tests hold it to)."""
    from fitgpt.estimate.pipeline_compose import stand_ins

    ranks = list(range(cfg.pipeline_parallel)) if ranks is None else ranks
    target = target or Target(torch.device(device).type)
    on = (cfg, world, dtype, torch.device(device), target)
    if cfg.fsdp_offload and target.cuda:
        log.warning("--fsdp-offload under --pipeline-parallel: each rank's weights, gradients and optimizer state are "
                    "counted on the card, where they are not (an upper bound of its peak)")
    if whole or cfg.pipeline_schedule not in COMPOSED or not cfg.reshards_after_forward:
        done = _forked(_plan_rank, lambda done: [(r, (*on, r, None)) for r in ranks])
        return [done[r][1] for r in ranks]
    # A small step recorded for each rank, or for several ranks alike (`stand_ins`), each recorder planned beside its
    # recording; each other rank put together from its stand-in's as soon as that is recorded.
    by = stand_ins(cfg, ranks)

    def ready(done: dict) -> list[tuple[int, tuple]]:
        return [(c, (*on, c, None, tuple(r for r in ranks if by[r] == c))) for c in sorted(set(by.values()))] + [
            (r, (*on, r, done[by[r]][0])) for r in ranks if by[r] != r and by[r] in done]

    done = _forked(_plan_rank, ready)
    return [done[r][1] for r in ranks]


def _forked(fn, ready: Callable[[dict], list[tuple[object, tuple]]]) -> dict:
    """``fn(*call)`` for each ``(key, call)`` that ``ready(done)`` gives (asked again each time one finishes; ``done``:
    the results so far, by key), each in a copy of this process of its own: DTensor caches its sharding by a mesh's
    shape, and a second fake process group's mesh of the same shape found the first's, its groups gone ("could not
    resolve the process group": a second rank split by tensor parallelism, planned in the same process, or a second
    plan). As many at a time as there are CPUs (more only share them, and the memory), the next begun as one ends."""
    linux = sys.platform.startswith("linux")
    width = len(os.sched_getaffinity(0)) if linux else 1
    done: dict = {}
    running: dict = {}
    while True:
        startable = [(k, c) for k, c in ready(done) if k not in done and k not in running]
        if startable and not linux:  # one at a time, in a spawned process
            key, call = startable[0]
            done[key] = in_own_process(fn, *call)
            continue
        for key, call in startable[:width - len(running)]:
            running[key] = Forked(fn, *call, fresh=True)
        if not running:
            return done
        finished = select.select(list(running.values()), [], [])[0]
        for key in [k for k, f in running.items() if f in finished]:
            done[key] = running.pop(key).result()


@dataclass(frozen=True)
class Recording:
    """A rank's small step, recorded and checked (`fitgpt.estimate.pipeline_compose.Recorded`), and the receive buffers
    it kept for each micro-batch."""

    recorded: object
    per_batch: int


def _plan_rank(cfg: TrainConfig, world: int, dtype: torch.dtype | None, device: torch.device, target: Target,
               pp_rank: int, recording: Recording | None, serves: tuple[int, ...] = ()) -> tuple[Recording | None, StageRank]:
    """Rank ``pp_rank``'s plan: put together from ``recording`` (`fitgpt.estimate.pipeline_compose`), or with
    ``serves``, from its own small step recorded first, showing every kind of action of the ranks it serves (returned
    for them; None where there is none smaller than the real step, or it cannot be composed from); where there is no
    recording or it cannot be composed from, its whole step run."""
    from fitgpt.estimate.pipeline_compose import NotComposable, small_config

    t0, pp, r = time.perf_counter(), cfg.pipeline_parallel, target.round_to
    with fake_ranks(world, cfg.tensor_parallel, pp, rank=pp_rank * (world // pp)) as mesh:  # the stage's first rank
        build = functools.partial(_built, mesh=mesh, world=world, dtype=dtype, device=device, target=target)
        small = small_config(cfg, pp_rank, serves) if serves else None
        try:
            recording = Recording(*_record(small, pp_rank, build, r)) if small is not None else recording
        except NotComposable as e:
            log.warning("pipeline rank %d: its small step cannot be composed from (%s)", pp_rank, e)
        plan = None
        if recording is not None:
            try:
                plan = _composed(cfg, recording, pp_rank, build, r)
            except NotComposable as e:
                log.warning("pipeline rank %d: planned from its whole step (%s)", pp_rank, e)
        plan = plan or _whole(cfg, pp_rank, build, r)
    return recording, dataclasses.replace(plan, seconds=time.perf_counter() - t0)


@contextlib.contextmanager
def _built(cfg: TrainConfig, mesh, world: int, dtype: torch.dtype | None, device: torch.device,
           target: Target) -> Iterator[tuple[object, torch.optim.Optimizer, Callable[[], object]]]:
    """This rank's pipeline of ``cfg`` (the trainer's, on fake tensors), its optimizer, and its step (a call), with
    the contexts a step runs in entered."""
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.device import autocast
    from fitgpt.estimate.cuda_autocast import cuda_autocast_rules
    from fitgpt.float8 import convert
    from fitgpt.memory.fake import fake_mode, fake_module
    from fitgpt.model import Transformer
    from fitgpt.optim import StateLayout, build_optimizer
    from fitgpt.parallel.fsdp import precision_roles
    from fitgpt.parallel.pipeline import prepare_pipeline
    from fitgpt.parallel.tensor import step_context
    from fitgpt.step import train_step

    amp_dtype, param_dtype = precision_roles(dtype, world > cfg.pipeline_parallel * cfg.tensor_parallel)
    # A CUDA step's tensors get CUDA autocast's dtypes, not the CPU's the fake step runs on.
    rules = cuda_autocast_rules() if target.cuda and device.type != "cuda" and amp_dtype else contextlib.nullcontext()
    mode = fake_mode()
    with torch.device("meta"):
        model = fake_module(convert(Transformer(cfg.model), cfg.float8), device, mode)
    # Planned in eager mode, as every plan is (`fitgpt.plan.auto` says so of --compile).
    pipe = prepare_pipeline(model, parse_policy(cfg.activation_checkpointing), dataclasses.replace(cfg, compile=False),
                            mesh, device, param_dtype, StateLayout(cfg.optim))
    with mode, rules:
        optimizer = build_optimizer(pipe.held, cfg.optim, torch.device(target.device), seed=cfg.seed)
        ids = torch.zeros(cfg.batch_size, cfg.model.context_length, dtype=torch.long, device=device)  # (B, T)
        step = dict(amp=autocast(device, amp_dtype), grad_clip=cfg.optim.grad_clip, check=False)  # fake: no values
        with step_context(pipe.held):  # loss_parallel, where the head is split on the vocabulary
            yield pipe, optimizer, lambda: train_step(pipe, optimizer, [(ids, ids)], **step)


def _whole(cfg: TrainConfig, pp_rank: int, build, r: int) -> StageRank:
    """The rank's whole step run, after a first that makes the optimizer's state and the receive buffers."""
    from fitgpt.estimate.pipeline_compose import levels
    from fitgpt.estimate.pipeline_marks import Recorder
    from fitgpt.memory.timeline import PeakProbe

    with build(cfg) as (pipe, optimizer, step):
        step()
        rec = Recorder(r)
        with PeakProbe(pipe.held, optimizer, pipe.comm_buffers(), round_to=r, allocator=rec) as probe:
            rec.clear()  # from what is held on: the step's rise and fall
            step()
        return _rank_plan(pp_rank, pipe, optimizer, probe.result, r, levels(rec.tokens, probe.held))


def _record(small: TrainConfig, pp_rank: int, build, r: int) -> tuple[object, int]:
    """The rank's small step recorded and checked, and the receive buffers it keeps for each micro-batch."""
    from fitgpt.estimate.pipeline_compose import NotComposable, levels, parse
    from fitgpt.estimate.pipeline_marks import Recorder, marked
    from fitgpt.memory.timeline import PeakProbe, unique_bytes

    with build(small) as (pipe, optimizer, step):
        rec = Recorder(r)
        # Its first step: it runs its actions as every later one does, having made its receive buffers first (counted
        # as held, made before it); what follows the schedule (the optimizer's first step) is not read.
        with PeakProbe(pipe.held, optimizer, round_to=r, allocator=rec) as probe, marked(pipe, rec):
            rec.clear()
            step()
        if probe.held + max(levels([t for t in rec.tokens if isinstance(t, int)])) != probe.result.peak:
            raise NotComposable("the recorded allocations do not add up to the small step's peak")
        rec.unmade(pipe.comm_buffers())
        recorded = parse(rec, small, pp_rank)
        per_batch, left = divmod(unique_bytes(pipe.comm_buffers(), r), small.microbatches)
    if left:
        raise NotComposable("the receive buffers are not the same for every micro-batch")
    return recorded, per_batch


def _composed(cfg: TrainConfig, recording: Recording, pp_rank: int, build, r: int) -> StageRank:
    """The rank's step put together from ``recording``, and what follows the schedule run on the real rank's
    parameters, given gradients."""
    from fitgpt.estimate.pipeline_compose import compose, levels, tail
    from fitgpt.estimate.pipeline_marks import Recorder
    from fitgpt.memory.timeline import PeakProbe

    with build(cfg) as (pipe, optimizer, step):
        rec = Recorder(r)
        pipe.train_batch = functools.partial(_given_gradients, pipe, rec)
        step()  # the optimizer's state made
        with PeakProbe(pipe.held, optimizer, round_to=r, allocator=rec) as probe:
            rec.clear()
            step()
        per_batch = recording.per_batch
        start = probe.held + per_batch * cfg.microbatches  # the real step's receive buffers besides
        schedule = levels(compose(recording.recorded, cfg, pp_rank), start)
        trace = schedule + levels(tail(rec.tokens), schedule[-1])[1:]
        plan = _rank_plan(pp_rank, pipe, optimizer, probe.result, r, trace)
        return dataclasses.replace(plan, buffers=per_batch * cfg.microbatches, peak=max(trace), composed=True)


def _given_gradients(pipe, rec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place of the schedule's step: each parameter given a gradient of its shape, as the backward leaves them."""
    from fitgpt.estimate.pipeline_marks import Mark

    for p in pipe.held.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    loss = torch.zeros((), device=x.device)
    rec.mark(Mark("end"))
    return loss


def _rank_plan(pp_rank: int, pipe, optimizer, result, r: int, trace: list[int]) -> StageRank:
    from fitgpt.memory.timeline import optimizer_state_bytes, param_bytes, unique_bytes

    blocks = tuple((s.blocks[0], s.blocks[-1]) for s in pipe.stages)
    return StageRank(rank=pp_rank, blocks=blocks, peak=result.peak, params=param_bytes(pipe.held, r), grads=result.grads,
                     optimizer=optimizer_state_bytes(optimizer, r), buffers=unique_bytes(pipe.comm_buffers(), r),
                     trace=thinned(trace))
