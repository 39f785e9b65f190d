"""A pipeline's memory, planned per rank: each stage's rank runs the trainer's own pipeline step (its stages,
checkpointed and sharded as the trainer does them, run by the same PyTorch schedule) on fake tensors, as that rank of
a fake process group, and its peak is read as the trainer's probe reads a real one.

No composition of per-block profiles is trusted here: what a schedule holds depends on the order it runs the
micro-batches in (GPipe every forward first, 1F1B at most P - s in flight on stage s, interleaved its own table), the
receive buffers it keeps for every micro-batch, the sends whose work holds a stage's output to the step's end, and the
head on the last stage only. Running the schedule gives all of them; fake tensors make it seconds for any size. A
stage's data-parallel ranks (FSDP's) hold the same shapes, so the first of them stands for all.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass

import torch

from fitgpt.config import STAGES_PER_RANK, TrainConfig
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.ranks import fake_ranks, in_own_process
from fitgpt.utils import Forked


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
    trace: tuple[int, ...] = ()
    """Bytes alive over its step, allocation by allocation (at most ``TRACE_POINTS``, each the most of its stretch,
    so that no peak is lost): what ``plan --report`` draws."""

    @property
    def activations(self) -> int:
        """What the step adds over what is held across steps: activations in flight, sends held, temporaries."""
        return self.peak - self.params - self.grads - self.optimizer - self.buffers

    def describe_blocks(self) -> str:
        return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in self.blocks)


TRACE_POINTS = 600


class _Trace:
    """Bytes alive after each allocation and free of a step, fed by ``LiveMemory`` as an allocator is."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.now, self.points = 0, []

    def malloc(self, key: int, nbytes: int) -> None:
        self.sizes[key] = nbytes
        self.now += nbytes
        self.points.append(self.now)

    def free(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)
        self.points.append(self.now)

    def thinned(self, most: int = TRACE_POINTS) -> tuple[int, ...]:
        """At most ``most`` points, each the largest of its stretch of the step."""
        n = len(self.points)
        if n <= most:
            return tuple(self.points)
        return tuple(max(self.points[i * n // most:(i + 1) * n // most]) for i in range(most))


def bubble(pp: int, schedule: str, microbatches: int) -> float:
    """The fraction of a step each rank waits (the pipeline filling and draining): (P - 1) / (v M + P - 1), v the
    stages a rank holds (interleaving shrinks each stage's time by v), M the micro-batches (Narayanan et al. 2021)."""
    v = STAGES_PER_RANK[schedule]
    return (pp - 1) / (v * microbatches + pp - 1)


def pipeline_step_time(whole: float, pp: int, schedule: str, microbatches: int) -> float:
    """A step's seconds under the pipeline, from ``whole``: the same batch's forward, backward and step on one rank
    holding every block. Each rank computes 1/P of it, and waits the bubble besides (the sends are not timed)."""
    return whole / pp / (1 - bubble(pp, schedule, microbatches))


def plan_pipeline(cfg: TrainConfig, world: int, dtype: torch.dtype | None = None, device: str = "cpu",
                  target: Target | None = None, ranks: list[int] | None = None) -> list[StageRank]:
    """Each pipeline rank's plan (or those of ``ranks``) for ``cfg`` (--pipeline-parallel, its schedule, micro-batches,
    checkpointing policy and optimizer) over ``world`` processes, training in ``dtype`` (autocast's, or under FSDP the
    gathered weights'; None: fp32) on ``target`` (a CUDA card: its allocator's 512-byte blocks and CUDA autocast's
    dtypes; by default the device itself)."""
    ranks = list(range(cfg.pipeline_parallel)) if ranks is None else ranks
    target = target or Target(torch.device(device).type)
    calls = [(cfg, world, r, dtype, torch.device(device), target) for r in ranks]
    # Each rank in a copy of this process of its own, side by side: DTensor caches its sharding by a mesh's shape, and
    # a second fake process group's mesh of the same shape found the first's, its groups gone ("could not resolve
    # the process group": a second rank split by tensor parallelism, planned in the same process, or a second plan).
    if sys.platform.startswith("linux"):
        copies = [Forked(_plan_rank, *call, fresh=True) for call in calls]
        return [c.result() for c in copies]
    return [in_own_process(_plan_rank, *call) for call in calls]


def _plan_rank(cfg: TrainConfig, world: int, pp_rank: int, dtype: torch.dtype | None, device: torch.device,
               target: Target) -> StageRank:
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.device import autocast
    from fitgpt.estimate.cuda_autocast import cuda_autocast_rules
    from fitgpt.memory.fake import fake_mode, fake_module
    from fitgpt.memory.timeline import PeakProbe, optimizer_state_bytes, param_bytes, unique_bytes
    from fitgpt.model import Transformer
    from fitgpt.optim import build_optimizer, optimizer_params
    from fitgpt.parallel.fsdp import precision_roles
    from fitgpt.parallel.pipeline import prepare_pipeline
    from fitgpt.parallel.tensor import step_context
    from fitgpt.step import train_step

    t0, r = time.perf_counter(), target.round_to
    amp_dtype, param_dtype = precision_roles(dtype, world > cfg.pipeline_parallel * cfg.tensor_parallel)
    # A CUDA step's tensors get CUDA autocast's dtypes, not the CPU's the fake step runs on.
    rules = cuda_autocast_rules() if target.cuda and device.type != "cuda" and amp_dtype else contextlib.nullcontext()
    pp, tp = cfg.pipeline_parallel, cfg.tensor_parallel
    with fake_ranks(world, tp, pp, rank=pp_rank * (world // pp)) as mesh:  # the first of the stage's ranks
        mode = fake_mode()
        with torch.device("meta"):
            model = fake_module(Transformer(cfg.model), device, mode)
        pipe = prepare_pipeline(model, parse_policy(cfg.activation_checkpointing), cfg, mesh, device, param_dtype,
                                optimizer_params)
        with mode, rules:
            optimizer = build_optimizer(pipe.held, cfg.optim, torch.device(target.device), seed=cfg.seed)
            ids = torch.zeros(cfg.batch_size, cfg.model.context_length, dtype=torch.long, device=device)  # (B, T)
            step = dict(amp=autocast(device, amp_dtype), grad_clip=cfg.optim.grad_clip, check=False)  # fake: no values
            with step_context(pipe.held):  # loss_parallel, where the head is split on the vocabulary
                train_step(pipe, optimizer, [(ids, ids)], **step)  # the first step makes the state and the buffers
                trace = _Trace()
                with PeakProbe(pipe.held, optimizer, pipe.comm_buffers(), round_to=r, allocator=trace) as probe:
                    trace.points = [trace.now]  # from what is held on: the step's rise and fall
                    train_step(pipe, optimizer, [(ids, ids)], **step)
        blocks = tuple((s.blocks[0], s.blocks[-1]) for s in pipe.stages)
        return StageRank(rank=pp_rank, blocks=blocks, peak=probe.result.peak, params=param_bytes(pipe.held, r),
                         grads=probe.result.grads, optimizer=optimizer_state_bytes(optimizer, r),
                         buffers=unique_bytes(pipe.comm_buffers(), r), seconds=time.perf_counter() - t0,
                         trace=trace.thinned())
