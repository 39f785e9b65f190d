"""A finished multi-rank run exits 0 (issue 68): no thread of gloo's, nor the heartbeat's, outlives the run into the
interpreter's shutdown, where a gloo worker letting go of a finished collective's tensors aborted the process
("terminate called without an active exception") after its last checkpoint and summary, more often the busier the
machine. DTensor's caches kept FSDP's and tensor parallelism's meshes, and each mesh its process group, past
``destroy_process_group``."""

import subprocess
import sys
import threading

import pytest
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
                                                       timeout=300):
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
