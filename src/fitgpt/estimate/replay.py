"""The chosen plan's step replayed on fake tensors through a model of CUDA's caching allocator.

The solver composes a plan's peak from per-block profiles: the bytes of the tensors, each rounded to
an allocator block. What the card reports also depends on the order of requests: blocks handed out
whole because what would remain is too small to split (``max_memory_allocated``), and the segments
taken from the driver (``max_memory_reserved``, which is what runs out). Both come from replaying the
real sequence of allocations and frees of the plan's step, in seconds, with no GPU.

A deep model's step is recorded at a shallow depth and deepened (``fitgpt.estimate.deepen``), with the weights and
the optimizer's update taken at full depth; tested equal, allocation by allocation, to the full-depth step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.activation_checkpoint.apply import find_blocks
from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.cuda_autocast import cuda_autocast_rules
from fitgpt.estimate.deepen import Event, NotAlike, Recorder, Recording, deepen, feed, repeated
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.heaviest import on_each_rank
from fitgpt.estimate.ranks import fake_meshes
from fitgpt.estimate.source import ModelSource, as_source
from fitgpt.estimate.subject import fake_model
from fitgpt.memory.allocator import CachingAllocatorModel, allocator_model
from fitgpt.memory.snapshot import ExactAllocator, SnapshotTrace, Where
from fitgpt.memory.timeline import block_marks, model_tensors, optimizer_state_tensors
from fitgpt.memory.tracker import LiveMemory, storages
from fitgpt.model import ModelConfig
from fitgpt.optim import build_optimizer
from fitgpt.parallel.data import ddp_wrap, sync_context
from fitgpt.parallel.fsdp import fsdp_shard, precision_roles
from fitgpt.parallel.tensor import apply_tensor_parallel, step_context
from fitgpt.step import optimizer_update, train_step
from fitgpt.utils import Forked

log = logging.getLogger(__name__)

SHALLOW = {None: (1, 1, 2), "fsdp": (4, 3, 2)}
"""Blocks kept before the one repeated (in the model's first run; in the others) and after it, in each run of blocks
alike (one process; FSDP): the repeated block's neighbours must run as it does. A block's backward frees what the
blocks either side made; under FSDP a forward frees what the gathers two blocks back left. Where the option changes,
the first block's forward (FSDP) and the backward of the block before it run otherwise, as do the model's first
blocks under FSDP and its first and last backward (seen on the recordings; `deepen` checks what it relies on)."""


def simulate_step(model: ModelConfig | ModelSource, policy: str, batch: int, context: int, grad_accum: int, dtype: torch.dtype | None,
                  optim: OptimConfig, target: Target, allocator=None, ranks: int = 1, parallel: str = "fsdp",
                  repeat: bool = True, deep: bool | None = None, tp: int = 1,
                  reshard_after_forward: bool = True) -> dict[str, int]:
    """Peak allocated and reserved bytes of a steady-state step of ``policy`` on ``target``: one process, or one rank
    of ``ranks`` under ``parallel`` (fsdp or ddp), wrapped as the trainer wraps it (``fitgpt.parallel``), on fake ranks;
    ``tp`` above 1: each group of ``tp`` ranks splits the model (``fitgpt.parallel.tensor``), FSDP over the groups.

    The weights are allocated first, then DDP's gradient buckets, then the cuBLAS workspaces; a first step creates
    the optimizer state; the second is measured, its token batches included. Each step runs up to two micro-batches
    (later ones repeat the second; DDP all-reduces the last one only). ``allocator``: the model replayed through (default:
    CUDA's, fresh for each rank `fitgpt.estimate.heaviest` sets apart; the heaviest's peaks are returned). ``repeat``:
    the second step is the first's allocations replayed again, less the optimizer state, where that is what it would
    do (`fitgpt.estimate.deepen.repeated`); False: run on fake tensors as the first. ``deep``: with ``repeat``, record a
    shallow step and deepen it (None: where the model is deep enough to gain; False: never), else step the full depth.
    ``reshard_after_forward``: as `fitgpt.parallel.fsdp.fsdp_shard` takes it.
    """
    source = as_source(model)
    if context > source.context_length:
        source = source.at(context=context)
    run = _Run(source, policy, batch, context, min(grad_accum, 2), dtype, optim, target, _data_parallel(parallel, ranks, tp),
               reshard=reshard_after_forward)
    def peaks_of(dp, tp_mesh) -> dict[str, int]:  # one rank's
        alloc = allocator if allocator is not None else allocator_model(target.expandable_segments)
        return _simulated(dataclasses.replace(run, mesh=dp, tp_mesh=tp_mesh), alloc, repeat, deep)

    peaks = on_each_rank(source, optim, ranks, tp, peaks_of, split=run.parallel == "fsdp" or tp > 1)
    return {k: max(p[k] for p in peaks) for k in peaks[0]}  # the heaviest rank's


def _simulated(run: _Run, alloc, repeat: bool, deep: bool | None) -> dict[str, int]:
    shallow = _deepened_from(run, deep) if repeat else None
    if shallow is not None:
        try:
            return _deep_replay(run, shallow, alloc)
        except NotAlike as e:  # exact or not at all: the full depth is stepped instead
            log.debug("replayed at full depth: %s", e)
    return _replay(run, alloc, repeat)


def predicted_snapshot(model: ModelConfig | ModelSource, policy: str, batch: int, context: int, grad_accum: int,
                       dtype: torch.dtype | None, optim: OptimConfig, target: Target, ranks: int = 1,
                       parallel: str = "fsdp", tp: int = 1, reshard_after_forward: bool = True) -> dict:
    """The plan's step as PyTorch's memory snapshot (`fitgpt.memory.snapshot`), as ``simulate_step`` replays it but at
    full depth and named: the weights, what is made before the step (DDP's buckets, the cuBLAS workspaces, the
    optimizer), a first step (which creates the optimizer state), then a second, each block's frames naming the step,
    its phase (forward or backward of which block, the optimizer step) and the op. Through CUDA's caching allocator
    (modelled) for a CUDA target; for the CPU, as the host allocates (a segment a tensor)."""
    source = as_source(model)
    if context > source.context_length:
        source = source.at(context=context)
    run = _Run(source, policy, batch, context, min(grad_accum, 2), dtype, optim, target, _data_parallel(parallel, ranks, tp),
               reshard=reshard_after_forward)
    where = Where()
    trace = SnapshotTrace(allocator_model(target.expandable_segments) if target.cuda else ExactAllocator(), where.frames)

    def marked_update(*args):
        where.mark(f"step {where.step}: optimizer step")
        return optimizer_update(*args)

    with _ranks(run, ranks, tp):
        model_, mode = run.build(run.source, run.policy)
        where.mark("weights")
        feed(trace, [(("w", i), nbytes) for i, nbytes in enumerate(_weights(model_))])
        where.mark("made before the step: DDP's buckets, cuBLAS workspaces, the optimizer")
        with run.stepping(model_, mode, trace, marked_update) as (step, _, live):
            blocks = find_blocks(model_)[1]
            where.live, where.n_blocks = live, len(blocks)
            with block_marks(blocks, where.mark):
                for where.step in (1, 2):
                    where.mark(f"step {where.step}: forward, embedding")
                    step()
    settings = {"expandable_segments": target.expandable_segments} if target.cuda else {"host": "one segment a tensor"}
    return trace.snapshot(settings)


@dataclass
class _Run:
    """One replay's step: the model, its plan and the step's shape, and the fake ranks it runs on."""

    source: ModelSource
    policy: str
    batch: int
    context: int
    micro: int
    """Micro-batches a step runs (later ones would repeat the second)."""
    dtype: torch.dtype | None
    optim: OptimConfig
    target: Target
    parallel: str | None
    """fsdp or ddp over the fake (data-parallel) ranks; None: one process, or one tensor-parallel group."""
    mesh: object = None
    """The data-parallel ranks' mesh."""
    tp_mesh: object = None
    """A tensor-parallel group's mesh (None: the model is not split)."""
    reshard: bool = True
    """Under FSDP, each block's gathered weights freed after its forward."""

    def build(self, source: ModelSource, policy: str | None) -> tuple[torch.nn.Module, object]:
        """``source``'s fake model, its checkpointing applied (``policy``; None: none) and sharded as the trainer
        shards it, and its fake mode."""
        model, mode = fake_model(source, torch.device("cpu"))
        if self.tp_mesh is not None:  # split first, as the trainer does
            with mode:
                apply_tensor_parallel(model, self.tp_mesh)
        if policy is not None:
            apply_activation_checkpointing(model, policy)
        if self.parallel == "fsdp":
            with mode:
                fsdp_shard(model, precision_roles(self.dtype, True)[1], mesh=self.mesh, reshard_after_forward=self.reshard)
        return model, mode

    @contextlib.contextmanager
    def stepping(self, model, mode, allocator, update: Callable | None = None):
        """Inside it, ``step()`` runs a training step of ``model``; yields (step, optimizer, the LiveMemory feeding
        ``allocator``). DDP's buckets are made as it is built, after the weights; then the cuBLAS workspaces.
        ``update``: as ``train_step`` takes it."""
        t, dtype = self.target, self.dtype
        math_only = t.attention_backend(dtype, self.source.head_dim) == "math"
        amp = autocast(torch.device("cpu"), precision_roles(dtype, self.parallel == "fsdp")[0])  # FSDP: pure half precision
        rules = cuda_autocast_rules() if t.cuda and dtype else contextlib.nullcontext()  # CUDA's casts, on CPU tensors
        attention = sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext()
        with mode, rules, LiveMemory(allocator=allocator) as live, attention, step_context(model):
            step_model = ddp_wrap(model, fake=True) if self.parallel == "ddp" else model  # its buckets, made as it is built
            _workspaces(allocator, t)
            optimizer = build_optimizer(model, self.optim, torch.device(t.device))
            kw = {"amp": amp, "grad_clip": self.optim.grad_clip, "check": False, "update": update,
                  "sync": lambda last: sync_context(step_model, last)}

            def step():
                tokens = (self.batch, self.context)  # (B, T) ids and targets, two tensors
                batches = [(torch.zeros(tokens, dtype=torch.long), torch.zeros(tokens, dtype=torch.long)) for _ in range(self.micro)]
                return train_step(step_model, optimizer, batches, **kw)

            yield step, optimizer, live


def _data_parallel(parallel: str, ranks: int, tp: int) -> str | None:
    """What wraps the model over the data-parallel ranks: ``parallel`` where there are several, else None."""
    return parallel if ranks // tp > 1 else None


@contextlib.contextmanager
def _ranks(run: _Run, ranks: int, tp: int):
    """``ranks`` fake ranks for ``run`` while it lasts: its data-parallel mesh, and its tensor-parallel group's."""
    with fake_meshes(ranks, tp) as (run.mesh, run.tp_mesh):
        yield


def _workspaces(alloc, target: Target) -> None:
    """cuBLAS's workspaces, one per handle (two: the forward's stream and the autograd engine's)."""
    for handle in range(target.workspace_bytes() and 2):
        alloc.malloc(-1 - handle, target.workspace_bytes() // 2)


def _weights(model: torch.nn.Module) -> list[int]:
    """Bytes of the model's parameter and buffer storages (this rank's shards under FSDP), in order, each once."""
    return [st.nbytes() for st in {id(st): st for p in model_tensors(model) for st in storages(p)}.values()]


def _state_keys(optimizer) -> set[int]:
    return {id(st) for t in optimizer_state_tensors(optimizer) for st in storages(t)}  # keyed as LiveMemory keys


def _replay(run: _Run, alloc, repeat: bool) -> dict[str, int]:
    model, mode = run.build(run.source, run.policy)
    feed(alloc, [(("w", i), nbytes) for i, nbytes in enumerate(_weights(model))])
    first = Recorder(alloc)
    with run.stepping(model, mode, alloc) as (step, optimizer, live):
        live.allocator = first
        step()  # as every step: DDP then keeps its gradients
        live.allocator = alloc
        alloc.reset_peaks()
        cleared = all(p.grad is None for p in model.parameters())  # else the next step adds into them: not a repeat
        again = repeated(first.events, _state_keys(optimizer)) if repeat and cleared else None
        if again is None:
            step()
        else:
            feed(alloc, again)
    return {"max_allocated": alloc.peak_allocated, "max_reserved": alloc.peak_reserved}


def _deepened_from(run: _Run, deep: bool | None) -> tuple[str, list[int], list[int]] | None:
    """The shallow step (``_shallow``) to record ``run`` from and deepen, or None to step the full depth: a model that
    changes depth, one process or FSDP, the optimizer stepping after the backward on the device, and a shallow step
    shorter (``deep=None``: by 4 blocks at least)."""
    o = run.optim
    if deep is False or run.parallel not in SHALLOW or not run.source.resizable or o.in_backward or o.offload:
        return None
    shallow = _shallow(run)
    shorter = shallow is not None and len(shallow[1]) < run.source.n_blocks - (0 if deep else 3)
    return shallow if shorter else None


def _shallow(run: _Run) -> tuple[str, list[int], list[int]] | None:
    """The shallow step: its policy, its blocks (the full model's ids) and how many times each runs at full depth (a run
    of blocks alike keeps SHALLOW's blocks either side of one repeated); None for a plan of groups of blocks."""
    first, later, after = SHALLOW[run.parallel]
    n, policy = run.source.n_blocks, parse_policy(run.policy)
    regions = policy.regions(n)
    if len(regions) != n:
        return None
    alike = [(r.recompute, r.offload) for r in regions]
    ids, copies, a = [], [], 0
    while a < n:
        b = a
        while b + 1 < n and alike[b + 1] == alike[a]:
            b += 1
        before = later if a else first
        if b - a + 1 > before + 1 + after:
            ids += [*range(a, a + before + 1), *range(b - after + 1, b + 1)]
            copies += [1] * before + [b - a + 1 - before - after] + [1] * after
        else:
            ids += range(a, b + 1)
            copies += [1] * (b - a + 1)
        a = b + 1
    return policy.of_blocks(ids, n), ids, copies


def _deep_replay(run: _Run, shallow: tuple[str, list[int], list[int]], alloc) -> dict[str, int]:
    """``_replay``'s step recorded shallow (``_shallow``) and deepened, with the weights and the optimizer (built, and its
    update, which runs over every parameter at once) taken from the full-depth model: recorded in a forked copy of this
    process meanwhile, and kept for the next plan's replay."""
    key = repr((run.source, run.optim, run.dtype, run.target, run.parallel, run.mesh and run.mesh.size(),
                run.tp_mesh and run.tp_mesh.size()))
    kept = _FULL_DEPTH.get(key)
    with Forked(_record_full_depth, run) if kept is None else contextlib.nullcontext() as job:
        rec, copies, out = _record_shallow(run, shallow)
        weights, made, update, state, update_out = kept or job.result()
    _FULL_DEPTH.clear()  # one model at a time
    _FULL_DEPTH[key] = weights, made, update, state, update_out
    if [n for _, n in out] != [n for _, n in update_out]:
        raise NotAlike("the shallow and full-depth updates return different tensors")
    events = deepen(rec, copies, update, [(t, k) for (t, _), (k, _) in zip(out, update_out)])
    again = repeated(events, state)
    if again is None:
        raise NotAlike("the deepened step leaves more than the optimizer state alive")
    feed(alloc, [(("w", i), nbytes) for i, nbytes in enumerate(weights)])
    _workspaces(alloc, run.target)
    feed(alloc, made + events)  # the optimizer as it is built, then the first step
    alloc.reset_peaks()
    feed(alloc, again)
    return {"max_allocated": alloc.peak_allocated, "max_reserved": alloc.peak_reserved}


_FULL_DEPTH: dict[str, tuple] = {}


def _record_shallow(run: _Run, shallow: tuple[str, list[int], list[int]]) -> tuple[Recording, list[int], list[tuple[int, int]]]:
    """The first step of ``run``'s shallow model (``shallow``: as ``_shallow`` gives it), recorded block by block; how
    many times each of its blocks runs at full depth; and (token, bytes) of what its update returned."""
    policy, ids, copies = shallow
    rec = Recording(len(ids))
    model, mode = run.build(run.source.at(n_blocks=len(ids)), policy)

    def marked_update(*args):
        # Not run: the full-depth update takes its place. What it returns is made here, as optimizer_update returns
        # it (the gradient norm, fp32, and whether it stepped; checked against the full-depth update's), for the step
        # to let go of after it. Running it on the shallow model's DTensors cost 1-2 s an 8B plan (measured).
        rec.mark("update")
        out = torch.zeros(()), torch.zeros((), dtype=torch.bool)
        rec.mark("update_end")
        return out

    with run.stepping(model, mode, CachingAllocatorModel(), marked_update) as (step, optimizer, live):
        live.allocator = rec  # the step's alone: the workspaces are fed apart
        with block_marks(find_blocks(model)[1], rec.mark):
            step()
        out = _returned(rec, _state_keys(optimizer))
        live.allocator = None  # the recording ends with the step, not as the model and optimizer are let go
    if not all(p.grad is None for p in model.parameters()):
        raise NotAlike("the step keeps its gradients: the next one adds into them")
    return rec, copies, out


def _returned(rec: Recording, state: set[int]) -> list[tuple[int, int]]:
    """(token, bytes) of what the recorded update made and did not free besides the optimizer state (``state``: its
    keys while alive), in order: what it returns (the gradient norm, whether it stepped)."""
    update = next(events for label, events in rec.segments if label == ("update",))
    made = {t: n for t, n in update if n is not None}
    freed = {t for t, n in update if n is None}
    kept = {rec.live[key] for key in state if key in rec.live}
    return [(t, n) for t, n in made.items() if t not in freed and t not in kept]


def _record_full_depth(run: _Run) -> tuple[list[int], list[Event], list[Event], set, list[Event]]:
    """The full-depth model's weights (bytes, in order); its optimizer's allocations and frees as it is built and in its
    first update; the keys of the state that creates; and (key, bytes) of what the update returns. The same for every
    plan of a model, step and optimizer."""
    model, mode = run.build(run.source, None)
    rec = Recording(0)
    with mode, LiveMemory(allocator=rec) as live:
        optimizer = build_optimizer(model, run.optim, torch.device(run.target.device))  # what its construction allocates
        live.allocator = None
        for p in model.parameters():  # the gradients the backward made (not the update's)
            p.grad = torch.zeros_like(p)
        total = torch.zeros(())  # the step's loss, made before the update
        live.allocator = rec
        rec.mark("update")
        returned = optimizer_update(model, optimizer, total, None, run.optim.grad_clip, False)
        state = _state_keys(optimizer)
        made, update = ([(("u", t), n) for t, n in events] for _, events in rec.segments)
        out = [(("u", t), n) for t, n in _returned(rec, state)]
        live.allocator = None
        del returned  # the step lets it go after the update: not recorded here
    return _weights(model), made, update, {("u", rec.live[k]) for k in state if k in rec.live}, out
