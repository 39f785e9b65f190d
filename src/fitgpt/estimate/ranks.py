"""N ranks in one process: PyTorch's fake process group, on which FSDP2 shards, gathers and reduces as it does
across N processes, with collectives that move nothing. The planner profiles one rank's step on it (rank 0;
under FSDP every rank holds the same shapes, shards padded alike)."""

from __future__ import annotations

import contextlib
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist


class RanksBusy(RuntimeError):
    """This process already belongs to a process group (a run under torchrun): N fake ranks cannot be made here."""


@contextlib.contextmanager
def fake_ranks(world: int) -> Iterator[object]:
    """A DeviceMesh of ``world`` fake ranks (this process as rank 0), for as long as the context lasts."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RanksBusy(f"a process group is already initialised; {world} fake ranks need a process of their own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        # Made outside any fake tensor mode: the mesh's setup reads values.
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


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
