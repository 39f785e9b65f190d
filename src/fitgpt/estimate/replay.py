"""The chosen plan's step replayed on fake tensors through a model of CUDA's caching allocator.

The solver composes a plan's peak from per-block profiles: the bytes of the tensors, each rounded to
an allocator block. What the card reports also depends on the order of requests: blocks handed out
whole because what would remain is too small to split (``max_memory_allocated``), and the segments
taken from the driver (``max_memory_reserved``, which is what runs out). Both come from replaying the
real sequence of allocations and frees of the plan's step, in seconds, with no GPU.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.cuda_autocast import cuda_autocast_rules
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.profile import fake_model
from fitgpt.estimate.ranks import fake_ranks
from fitgpt.estimate.source import ModelSource, as_source
from fitgpt.memory.allocator import CachingAllocatorModel
from fitgpt.memory.timeline import optimizer_state_tensors
from fitgpt.memory.tracker import LiveMemory, storages
from fitgpt.model import ModelConfig
from fitgpt.optim import build_optimizer
from fitgpt.parallel import ddp_wrap, fsdp_shard, precision_roles, sync_context
from fitgpt.step import train_step


def simulate_step(model: ModelConfig | ModelSource, policy: str, batch: int, context: int, grad_accum: int, dtype: torch.dtype | None,
                  optim: OptimConfig, target: Target, allocator=None, ranks: int = 1, parallel: str = "fsdp",
                  repeat: bool = True) -> dict[str, int]:
    """Peak allocated and reserved bytes of a steady-state step of ``policy`` on ``target``: one process, or one rank
    of ``ranks`` under ``parallel`` (fsdp or ddp), wrapped as the trainer wraps it (``fitgpt.parallel``), on fake ranks.

    The weights are allocated first, then DDP's gradient buckets, then the cuBLAS workspaces; a first step creates
    the optimizer state; the second is measured, its token batches included. Each step runs up to two micro-batches
    (later ones repeat the second; DDP all-reduces the last one only). ``allocator``: the model replayed through (default:
    CUDA's). ``repeat``: the second step is the first's allocations replayed again, less the optimizer state, where
    that is what it would do (``_Recorder.repeat``); False: run on fake tensors as the first.
    """
    with fake_ranks(ranks) if ranks > 1 else contextlib.nullcontext() as mesh:
        return _replay(as_source(model), policy, batch, context, grad_accum, dtype, optim, target, allocator,
                       mesh, parallel if ranks > 1 else None, repeat)


def _replay(source, policy, batch, context, grad_accum, dtype, optim, target, allocator, mesh, parallel,
            repeat) -> dict[str, int]:
    if context > source.context_length:
        source = source.at(context=context)
    model, mode = fake_model(source, torch.device("cpu"))
    apply_activation_checkpointing(model, policy)
    if parallel == "fsdp":
        with mode:
            fsdp_shard(model, precision_roles(dtype, True)[1], mesh=mesh)
    alloc = allocator if allocator is not None else CachingAllocatorModel()
    for st in {id(st): st for p in model.parameters() for st in storages(p)}.values():
        alloc.malloc(id(st), st.nbytes())
    math_only = target.attention_backend(dtype, source.head_dim) == "math"
    amp = autocast(torch.device("cpu"), precision_roles(dtype, parallel == "fsdp")[0])  # FSDP: pure half precision
    rules = cuda_autocast_rules() if target.cuda and dtype else contextlib.nullcontext()  # CUDA's casts, on CPU tensors
    with mode, rules, LiveMemory(allocator=alloc) as live, sdpa_kernel(SDPBackend.MATH) if math_only else contextlib.nullcontext():
        step_model = ddp_wrap(model, fake=True) if parallel == "ddp" else model  # its buckets, made as it is built
        for handle in range(target.workspace_bytes() and 2):
            alloc.malloc(-1 - handle, target.workspace_bytes() // 2)
        optimizer = build_optimizer(model, optim, torch.device(target.device))
        step_kw = {"amp": amp, "grad_clip": optim.grad_clip, "check": False,
                   "sync": lambda last: sync_context(step_model, last)}

        def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
            return [(torch.zeros(batch, context, dtype=torch.long), torch.zeros(batch, context, dtype=torch.long))
                    for _ in range(n)]

        micro = min(grad_accum, 2)
        first = _Recorder(alloc)
        live.allocator = first
        train_step(step_model, optimizer, batches(micro), **step_kw)  # as every step: DDP then keeps its gradients
        live.allocator = alloc
        alloc.reset_peaks()
        cleared = all(p.grad is None for p in model.parameters())  # else the next step adds into them: not a repeat
        state = {id(st) for t in optimizer_state_tensors(optimizer) for st in storages(t)}  # keyed as LiveMemory keys
        if not (repeat and cleared and first.repeat(state)):
            train_step(step_model, optimizer, batches(micro), **step_kw)
    return {"max_allocated": alloc.peak_allocated, "max_reserved": alloc.peak_reserved}


class _Recorder:
    """Passes a step's allocations and frees on to the allocator model, in order, to be repeated as the next step."""

    def __init__(self, alloc) -> None:
        self.alloc, self.events = alloc, []

    def malloc(self, key: int, nbytes: int) -> None:
        self.events.append((key, nbytes))
        self.alloc.malloc(key, nbytes)

    def free(self, key: int) -> None:
        self.events.append((key, None))
        self.alloc.free(key)

    def repeat(self, state: set[int]) -> bool:
        """Replay the step again, less the optimizer state it created (``state``: its storages' keys), where nothing
        else the step made outlives it and it freed nothing made before it; False (nothing replayed) otherwise.

        The second step then runs the same ops on tensors of the same sizes, in the same order: it is the first
        without the state's creation (tested equal, allocation by allocation). Skipping its fake ops halves the
        replay's time."""
        live: dict[int, int] = {}  # key -> the index of its allocation (a freed storage's id may be taken again)
        for i, (key, nbytes) in enumerate(self.events):
            if nbytes is not None:
                live[key] = i
            elif live.pop(key, None) is None:
                return False  # freed what an earlier step made (DDP rebuilding its buckets, say)
        if not live.keys() <= state:
            return False  # gradients kept between steps, say: the next step does not allocate them again
        kept = set(live.values())
        for i, (key, nbytes) in enumerate(self.events):
            if i in kept:
                continue
            if nbytes is None:
                self.alloc.free(("again", key))
            else:
                self.alloc.malloc(("again", key), nbytes)
        return True

