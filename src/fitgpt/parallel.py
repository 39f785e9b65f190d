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
    if tuple(whole.shape) != tuple(p.shape):
        raise ValueError(f"shape {tuple(whole.shape)}, the model's {tuple(p.shape)}")
    if hasattr(p, "to_local"):
        whole, p = shard_like(p, whole.to(p.device), src_data_rank=None).to_local(), p.to_local()
    p.copy_(whole)


# ---- a tensor split twice: GPT-2's query/key/value matrix split by heads, then sharded by FSDP ---------------------
# DTensor records the pair as two strided shards and, in PyTorch 2.13, gathers and scatters them out of order
# (full_tensor, distribute_tensor: checked on 2 x 2 gloo ranks). The step itself is exact; what moves whole tensors
# (checkpoints, the sharded start, --init-from) places each rank's rows itself.


def split_twice(t) -> bool:
    """A DTensor on the (dp, tp) mesh whose tensor-parallel split is strided (rows q_r, k_r, v_r of one matrix)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and t.device_mesh.ndim == 2 and isinstance(t.placements[1], _StridedShard)


def rows_held(t, dp_rank: int, tp_rank: int) -> torch.Tensor:
    """The rows of the whole ``t`` (split twice) that rank (dp_rank, tp_rank) holds, in its order: its heads' rows in
    each of the split's parts (q_r, k_r, v_r), then FSDP's chunk of those (torch.chunk's, as ``fully_shard`` cuts)."""
    mesh, split = t.device_mesh, t.placements[1]
    rows = torch.arange(t.shape[0]).view(split.split_factor, mesh.size(1), -1)[:, tp_rank].reshape(-1)
    chunks = torch.chunk(rows, mesh.size(0))
    return chunks[dp_rank] if dp_rank < len(chunks) else rows[:0]


def gather_whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on every rank (a collective where ``t`` is a DTensor); a plain tensor as it is."""
    import torch.distributed as dist

    if not split_twice(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    mesh, local = t.device_mesh, t.to_local()
    with unset_fake_temporarily():  # the mesh's ranks are a real tensor, also where the planner steps fake ones
        at = mesh.mesh.flatten().tolist()  # the mesh's ranks in (dp, tp) order; it spans the process group
    most = len(rows_held(t, 0, 0))  # the first chunk is the longest
    pieces = [local.new_empty((most, *local.shape[1:])) for _ in at]  # by global rank
    dist.all_gather(pieces, torch.cat([local, local.new_zeros((most - len(local), *local.shape[1:]))]))
    whole = local.new_empty(t.shape)
    for rank, piece in enumerate(pieces):
        rows = rows_held(t, *divmod(at.index(rank), mesh.size(1)))
        whole[rows] = piece[:len(rows)]
    return whole


def shard_like(p, whole: torch.Tensor, src_data_rank: int | None = 0):
    """``whole`` as a DTensor laid out as ``p`` is, each rank its own piece (``src_data_rank`` None: taken from its own
    copy of ``whole``, no rank sending; 0: rank 0's, as ``distribute_tensor`` does)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not split_twice(p):
        return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=src_data_rank)
    if src_data_rank is not None:
        import torch.distributed as dist

        dist.broadcast(whole, src=p.device_mesh.mesh.flatten()[src_data_rank].item())
    dp_rank, tp_rank = p.device_mesh.get_coordinate()
    return DTensor.from_local(whole[rows_held(p, dp_rank, tp_rank)], p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


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
