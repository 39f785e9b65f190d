"""FSDP2 or DDP around a model, as training runs it and as planning profiles it (on a fake process group).

One function each, so that the planner's per-rank step is exactly the trainer's: FSDP shards each block
(inside its activation-checkpoint wrapper, if it has one), then the root; parameters resharded after
the forward; the given mixed precision (parameters cast to ``param_dtype`` when gathered, gradients
reduced in fp32) and offload policy. DDP keeps the gradients as views into its all-reduce buckets.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from fitgpt.activation_checkpoint.apply import ActivationCheckpointWrapper, find_blocks
from fitgpt.model.transformer import fill_whole


def precision_roles(dtype: torch.dtype | None, fsdp: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, FSDP parameter dtype) of a run in ``dtype``. Under FSDP, pure half precision: parameters gathered
    in ``dtype`` and every op run in it, no autocast (ops autocast would keep in fp32, norms and softmax among them,
    run in ``dtype``; the loss alone is computed in fp32), gradients reduced in fp32, weights and optimizer state kept
    in fp32: as torchtitan trains. Otherwise autocast over fp32 weights."""
    return (None, dtype) if fsdp else (dtype, None)


def fsdp_shard(model: nn.Module, param_dtype: torch.dtype | None, offload: bool = False, pin_memory: bool = False,
               mesh=None) -> nn.Module:
    """``fully_shard`` each block, then the root, in place (``mesh``: the ranks; default, the process group's)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None else MixedPrecisionPolicy()
    kw = {"mp_policy": mp, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(), "mesh": mesh}
    _, blocks = find_blocks(model)
    for block in blocks:
        # Shard the block itself, not its checkpoint wrapper: a group's first wrapper runs the
        # other blocks of its group directly, and their own hooks must gather their weights.
        fully_shard(block.inner if isinstance(block, ActivationCheckpointWrapper) else block, **kw)
    fully_shard(model, **kw)
    return model


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each block's forward, in place, as torchtitan compiles a model FSDP shards: the compiled code
    is one block's arithmetic, run inside its checkpointing wrapper (recomputed as compiled code) and between FSDP's
    hooks, which gather and free the block's weights eagerly. Names and the state dict are unchanged."""
    _, blocks = find_blocks(model)
    for block in blocks:
        inner = block.inner if isinstance(block, ActivationCheckpointWrapper) else block
        inner.forward = torch.compile(inner.forward)


def ddp_wrap(model: nn.Module, device_ids: list[int] | None = None, fake: bool = False) -> nn.Module:
    """DDP around ``model``, its gradients views into the all-reduce buckets (no second copy of every gradient).

    ``fake``: on the planner's fake tensors and fake ranks, where nothing can be read: no first broadcast of the
    weights; each bucket's all-reduce done in place, as NCCL's and gloo's are (the fake process group's yields no
    tensor); and no rebuilding of the buckets in the second step (it reads rank 0's bucket order as values). A real
    rebuild frees the old buckets first; with accumulation, whose gradients still hold them, each as its successor is
    made: about one bucket (25 MiB) more, once. The buckets, the gradients' views and every other allocation of the
    step are DDP's own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, init_sync=not fake)
    if fake:
        ddp.register_comm_hook(None, _reduced_in_place)
        ddp.reducer = _KeepsBuckets(ddp.reducer)
    return ddp


class _KeepsBuckets:
    """DDP's reducer as the module calls it, with the buckets never rebuilt (the only call that differs)."""

    def __init__(self, reducer) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _reduced_in_place(state, bucket):  # unannotated: DDP checks a hook's annotations against its classes, not strings
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def sync_context(step_model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
    """The context a micro-batch runs in. DDP skips its all-reduce on all but the last: the gradients add up in its
    buckets, which are held anyway. FSDP reduce-scatters every micro-batch, as torchtitan does: between micro-batches
    a rank holds its shard of the gradients, never the whole model's unsharded."""
    if last_micro_batch or not hasattr(step_model, "no_sync"):
        return contextlib.nullcontext()
    return step_model.no_sync()


@torch.no_grad()
def fill_shard(p: torch.Tensor, std: float | None) -> None:
    """A `Transformer.init_weights` fill for a model sharded by ``fsdp_shard``: the whole parameter drawn on the CPU,
    as one process draws it, and this rank's shard of it kept (every rank draws alike, so no rank sends anything).
    One parameter whole at a time, never the model."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        fill_whole(p, std)
        return
    whole = torch.empty(p.shape, dtype=p.dtype)
    fill_whole(whole, std)
    assign_whole(p, whole)


@torch.no_grad()
def assign_whole(p: torch.Tensor, whole: torch.Tensor) -> None:
    """``p`` (a parameter, or this rank's shard of one) set from the whole tensor ``whole``, which every rank holds
    alike: a shard keeps its own piece, so no rank sends anything."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if tuple(whole.shape) != tuple(p.shape):
        raise ValueError(f"shape {tuple(whole.shape)}, the model's {tuple(p.shape)}")
    if isinstance(p, DTensor):
        whole = distribute_tensor(whole.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p = p.to_local()
    p.copy_(whole)


def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """A model built on the meta device and sharded: each rank's shards allocated on ``device`` and filled with the
    initial weights one process would draw from ``seed`` (its ``init_weights``)."""
    ties = _ties(model)
    model.to_empty(device=device)
    for module, name, (first, first_name) in ties:  # FSDP2 keeps a tied weight one; a plain to_empty makes it two
        if getattr(module, name) is not getattr(first, first_name):
            setattr(module, name, getattr(first, first_name))
    torch.manual_seed(seed)
    model.init_weights(fill_shard)


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """Each parameter registered a second time (a tied head), with where it was first."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in first:
                ties.append((module, name, first[id(p)]))
            elif p is not None:
                first[id(p)] = (module, name)
    return ties
