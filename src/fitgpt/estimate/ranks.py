"""N ranks in one process: PyTorch's fake process group, on which FSDP2 shards, gathers and reduces as it does
across N processes, with collectives that move nothing. The planner profiles one rank's step on it (rank 0;
under FSDP every rank holds the same shapes, shards padded alike), or each rank a whole-matrix step in the backward
sets apart (`fitgpt.estimate.heaviest`)."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist


class RanksBusy(RuntimeError):
    """This process already belongs to a process group (a run under torchrun): N fake ranks cannot be made here."""


@contextlib.contextmanager
def fake_ranks(world: int, tp: int = 1, pp: int = 1, rank: int = 0) -> Iterator[object]:
    """A DeviceMesh of ``world`` fake ranks (this process as ``rank``), for as long as the context lasts; with ``tp``
    above 1 and below ``world``, the trainer's 2-D mesh of them, ("dp", "tp"); with ``pp`` above 1, the pipeline's,
    ("pp",) or ("pp", "dp")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from fitgpt.parallel import pipeline, tensor  # the trainer's own meshes

    if dist.is_initialized():
        raise RanksBusy(f"a process group is already initialised; {world} fake ranks need a process of their own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with _pieces_when_indexed(), _meshes_joined_on_real_tensors(), _static_pipeline():
            # Made outside any fake tensor mode: the mesh's setup reads values.
            if pp > 1:
                yield pipeline.training_mesh("cpu", world, pp, tp)
            else:
                yield tensor.training_mesh("cpu", world, tp) if 1 < tp < world else init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_meshes(world: int, tp: int = 1, rank: int = 0) -> Iterator[tuple[object, object]]:
    """(data-parallel mesh, tensor-parallel group's mesh) of ``world`` fake ranks in groups of ``tp``, this process as
    ``rank``, for as long as the context lasts: each None where that dimension has one rank (both None for one
    process)."""
    with fake_ranks(world, tp, rank=rank) if world > 1 else contextlib.nullcontext() as mesh:
        if tp > 1 and world > tp:
            yield mesh["dp"], mesh["tp"]
        else:
            yield (mesh if tp == 1 else None), (mesh if tp > 1 else None)


class LazyChunks(Sequence):
    """``torch.chunk(t, n, dim)`` made up to ``n`` pieces with empty ones, as FSDP2's ``_chunk_with_empty`` returns it,
    each piece made only when it is indexed: the same view ``torch.chunk`` makes (``split`` narrows so)."""

    def __init__(self, t: torch.Tensor, n: int, dim: int) -> None:
        self.t, self.n, self.dim = t, n, dim
        self.size = t.size(dim)
        self.step = -(-self.size // n)  # torch.chunk's piece size; the last piece is shorter
        self.made = -(-self.size // self.step) if self.size else n  # the pieces torch.chunk makes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(i)
        i %= self.n
        if i >= self.made:
            return self[0].new_empty(0)
        start = i * self.step
        return self.t.narrow(self.dim, start, min(self.step, self.size - start))


@contextlib.contextmanager
def _meshes_joined_on_real_tensors() -> Iterator[None]:
    """FSDP2 over a tensor-parallel DTensor joins the two meshes (``DeviceMesh._concatenate``), which indexes the
    ranks' tensor: under the planner's fake tensor mode that tensor is real, and the join must be too."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__.get("_concatenate")
    if original is None:  # another layout of PyTorch's internals
        yield
        return

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


@contextlib.contextmanager
def _static_pipeline() -> Iterator[None]:
    """A pipeline's stages, each given its shapes (`fitgpt.parallel.pipeline`), vote at their first step that every
    stage has them (PyTorch's static mode): the product of the votes passed from rank to rank. A fake receive leaves
    its buffer as it was (zeros, a vote against): here each stage is told the outcome real ranks reach, with nothing
    sent."""
    try:
        from torch.distributed.pipelining.schedules import _PipelineSchedule
        from torch.distributed.pipelining.stage import InferenceMode
    except ImportError:
        _PipelineSchedule = None
    original = _PipelineSchedule and _PipelineSchedule.__dict__.get("_warmup_p2p")
    if original is None:  # another layout of PyTorch's internals: nothing to vote
        yield
        return

    def static(self, stages, has_backward, p2p_done) -> None:
        for stage in stages if isinstance(stages, list) else [stages]:
            stage._inference_mode = InferenceMode.STATIC

    _PipelineSchedule._warmup_p2p = static
    try:
        with _sends_held_by_their_work():
            yield
    finally:
        _PipelineSchedule._warmup_p2p = original


class _HeldWork:
    """A fake send's or receive's work, holding its tensor as long as it lives, as a real one does (gloo's work keeps
    the tensor it sends until the work is let go, which a schedule does at the end of its step)."""

    def __init__(self, work, tensors: list[torch.Tensor]) -> None:
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.work, name)


@contextlib.contextmanager
def _sends_held_by_their_work() -> Iterator[None]:
    """The schedule's sends and receives on fake ranks, each work holding its tensor as a real rank's does (a
    stage's output sent on, freed on a real rank only when the schedule lets its work go, not after its backward)."""
    from torch.distributed.pipelining import schedules

    original = getattr(schedules, "_batch_p2p", None)
    if original is None:  # another layout of PyTorch's internals
        yield
        return

    def batch_p2p(p2p_ops, desc=None):
        works = original(p2p_ops, desc=desc)
        if len(works) == len(p2p_ops):
            return [_HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops)]
        return [_HeldWork(w, [op.tensor for op in p2p_ops]) for w in works]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = original


@contextlib.contextmanager
def _pieces_when_indexed() -> Iterator[None]:
    """FSDP2 chunks each parameter into one piece per rank to keep its own rank's (and the first's, for the padded
    size). On fake tensors each piece costs a fake tensor: sharding an 8B model over 128 ranks made 88,000 of them, about
    5 s a sharding, and planning shards it in the profile and in every replay. Here only the pieces read are made."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:
        _fsdp_param = None
    original = getattr(_fsdp_param, "_chunk_with_empty", None)
    if original is None:  # another layout of PyTorch's internals: every piece is made, as FSDP makes them
        yield
        return
    _fsdp_param._chunk_with_empty = LazyChunks
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


def in_own_process(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` in a fresh Python process (one that belongs to no process group), its result returned."""
    with tempfile.TemporaryDirectory() as d:
        call, result = Path(d) / "call.pkl", Path(d) / "result.pkl"
        call.write_bytes(pickle.dumps((fn, args, kwargs)))
        subprocess.run([sys.executable, "-m", "fitgpt.estimate.ranks", d], check=True)
        return pickle.loads(result.read_bytes())


if __name__ == "__main__":  # the far end of in_own_process
    folder = Path(sys.argv[1])
    fn, args, kwargs = pickle.loads((folder / "call.pkl").read_bytes())
    (folder / "result.pkl").write_bytes(pickle.dumps(fn(*args, **kwargs)))
