"""Whole tensors into and out of any layout (FSDP's shards, tensor parallelism's splits, both): what checkpoints, the
sharded start, --init-from and a whole-matrix optimizer step move."""

from __future__ import annotations

import torch


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


def _split_only(t) -> bool:
    """A DTensor split by heads over a tensor-parallel mesh alone (strided rows, no FSDP): PyTorch gathers it with
    index arithmetic on tensors (``.tolist()``), which fake tensors cannot give, so a plan of a whole-matrix step over
    it stopped on a data-dependent op."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(t, DTensor) and t.device_mesh.ndim == 1 and isinstance(t.placements[0], _StridedShard)


def _sizes(mesh) -> tuple[int, int]:
    """(data-parallel, tensor-parallel) sizes of a (dp, tp) mesh, or of a tensor-parallel one (dp 1)."""
    return (mesh.size(0), mesh.size(1)) if mesh.ndim == 2 else (1, mesh.size(0))


def rows_held(t, dp_rank: int, tp_rank: int) -> torch.Tensor:
    """The rows of the whole ``t`` (split twice, or split by heads alone) that rank (dp_rank, tp_rank) holds, in its
    order: its heads' rows in each of the split's parts (q_r, k_r, v_r), then FSDP's chunk of those (torch.chunk's,
    as ``fully_shard`` cuts)."""
    split, (dp, tp) = t.placements[-1], _sizes(t.device_mesh)
    rows = torch.arange(t.shape[0]).view(split.split_factor, tp, -1)[:, tp_rank].reshape(-1)
    chunks = torch.chunk(rows, dp)
    return chunks[dp_rank] if dp_rank < len(chunks) else rows[:0]


def mesh_group(mesh) -> tuple[object, list[int]]:
    """The process group of ``mesh``'s ranks (None: a 2-D mesh without one, whose ranks are then every process) and
    those ranks, in (dp, tp) order. The mesh's own ranks (a pipeline stage's, of all the processes): the group the
    trainer's meshes flatten them into ahead (`training_mesh`), so that no rank makes a group here, which every
    process would have to join."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # the mesh's ranks are a real tensor, also where the planner steps fake ones
        at = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1:
        return mesh.get_group(), at
    return (mesh._flatten("dp_tp").get_group() if hasattr(mesh, "_flatten") else None), at


def gather_whole(t: torch.Tensor) -> torch.Tensor:
    """``t`` whole on every rank (a collective where ``t`` is a DTensor); a plain tensor as it is."""
    import torch.distributed as dist

    if not (split_twice(t) or _split_only(t)):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    mesh, local = t.device_mesh, t.to_local()
    group, at = mesh_group(mesh)
    order = at if group is not None else list(range(dist.get_world_size()))  # the pieces' ranks, as gathered
    most = len(rows_held(t, 0, 0))  # the first chunk is the longest
    pieces = [local.new_empty((most, *local.shape[1:])) for _ in order]
    dist.all_gather(pieces, torch.cat([local, local.new_zeros((most - len(local), *local.shape[1:]))]), group=group)
    whole = local.new_empty(t.shape)
    for rank, piece in zip(order, pieces):
        rows = rows_held(t, *divmod(at.index(rank), _sizes(mesh)[1]))
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
