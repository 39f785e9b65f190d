"""A finished multi-rank run exits 0 (issue 68): no thread of gloo's, nor the heartbeat's, outlives the run into the
interpreter's shutdown, where a gloo worker letting go of a finished collective's tensors aborted the process
("terminate called without an active exception") after its last checkpoint and summary, more often the busier the
machine. DTensor's caches kept FSDP's and tensor parallelism's meshes, and each mesh its process group, past
``destroy_process_group``."""

import subprocess
import sys
import threading

import pytest
from hang import guard
from test_distributed import finish, torchrun

from fitgpt.train import distributed as dist_utils


def _flags(data_dir, corpus_dir, out, *extra):
    return ["train", "--preset", "llama-tiny", "--data.dir", str(data_dir), "--data.inputs", str(corpus_dir),
            "--data.vocab-size", "512", "--batch-size", "2", "--max-steps", "2", "--checkpoint-interval", "2",
            "--eval-interval", "2", "--eval-batches", "1", "--out-dir", str(out), "--no-progress", "--no-tensorboard",
            *extra]


def _train_then_threads(rank: int, world: int, argv: list[str]) -> tuple:
    """Rank body: ``fitgpt ARGV`` as torchrun runs it, then the threads this process still has."""
    from rank_pool import _cli

    code, _, err = _cli(rank, world, argv)
    return code, err[-2000:], dist_utils.gloo_threads(), [t.name for t in threading.enumerate() if t.name == "fitgpt-heartbeat"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--parallel", "fsdp", "--optim.name", "galore-adamw", "--optim.rank", "8"],
                                   ["--parallel", "fsdp", "--tensor-parallel", "2"]], ids=["fsdp-galore", "fsdp-tp"])
def test_a_finished_run_leaves_no_thread_of_its_process_groups(data_dir, corpus_dir, tmp_path, ranks, extra):
    world = 4 if "--tensor-parallel" in extra else 2
    for code, err, gloo, heartbeat in ranks(world).run(_train_then_threads, _flags(data_dir, corpus_dir, tmp_path / "r", *extra),
                                                       timeout=guard(300)):
        assert code == 0, err
        assert gloo == [] and heartbeat == []


LOAD = "import time\nt = time.monotonic()\nwhile time.monotonic() - t < 600: pass\n"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_finished_torchrun_launches_exit_0_beside_two_busy_processes(data_dir, corpus_dir, tmp_path):
    """Two CPU-bound processes beside the ranks (as on a shared node): each launch that trained exits 0, GaLore and
    APOLLO under FSDP among them (`benchmarks/exit_check.py` runs 200)."""
    busy = [subprocess.Popen([sys.executable, "-c", LOAD]) for _ in range(2)]
    try:
        for i, optim in enumerate(["galore-adamw", "apollo-mini"]):
            out = tmp_path / f"r{i}"
            finish(torchrun(_flags(data_dir, corpus_dir, out, "--parallel", "fsdp", "--optim.name", optim), tmp_path))
            assert (out / "checkpoints" / "step_00000002").is_dir()
    finally:
        for p in busy:
            p.kill()


def _equal_mesh_after_release(rank: int, world: int, ports: list[int], released: bool) -> float:
    """Rank body: a 2 x 2 mesh's "tp" ranks double a sharded tensor, the groups are destroyed (``released``: and
    released, as `shutdown` does; else left as a process that made its own meshes leaves them, and fitgpt's
    `init_distributed` joins the next group), then groups are made anew (fewer before the mesh, so its own get other
    names) and an equal mesh does the same."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    def doubled(groups_before: int) -> float:
        _ = [dist.new_group(list(range(world))) for _ in range(groups_before)]
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))["tp"]
        return (distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]) * 2).full_tensor().sum().item()

    for i, port in enumerate(ports):
        if dist.is_initialized():
            dist.destroy_process_group()
            if released or i == 0:  # the first mesh meets caches emptied of whatever ran before on these ranks
                dist_utils.release_meshes()
        os.environ["MASTER_PORT"] = str(port)
        if released or i == 0:
            dist.init_process_group("gloo")
        else:
            dist_utils.init_distributed("cpu", 60.0)
        result = doubled(3 - 3 * i)
    return result


@pytest.mark.slow
@pytest.mark.parametrize("released", [True, False], ids=["released", "left-by-another"])
def test_a_mesh_made_after_the_groups_are_released_is_not_handed_an_old_ones_groups(ranks, released):
    """DTensor's sharding caches key an op by its meshes' shapes and hand back the mesh they first saw: after the
    groups were destroyed, an equal mesh's next collective named a group gone with them ("Could not resolve the process
    group registered under the name 7": the 2 x 2 flake of the shared ranks, issue 68; and a second run in one
    process). `release_meshes` empties those caches, and `init_distributed` empties them again: meshes left by
    whatever ran before in the process (a rank body of the shared ranks, then a run there: "name 5" in CI) are
    forgotten before a run makes its own."""
    from rank_pool import free_port

    assert ranks(4).run(_equal_mesh_after_release, [free_port(), free_port()], released) == [32.0] * 4
