"""A rank lost or stopped under one torchrun (issue 46, class 6 and item 4): the others say which rank in one line,
in seconds, and leave every checkpoint whole. (Two nodes, one lost: test_elastic.py.)"""

import os
import signal
import subprocess
import sys
import time

import pytest
from hang import guard
from rank_pool import free_port
from test_distributed import train_flags
from test_elastic import _rank_of, _workers

from fitgpt.train import checkpoint as ckpt

STALLED_S = 8  # --dist-stall-timeout here, against the default's 20 s: a test that waits less


def _launch(data_dir, corpus_dir, run, cwd, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "fitgpt", *train_flags(data_dir, corpus_dir, run, 100000, "--checkpoint-interval", "2", "--dist-timeout", "300",
                                        *extra)]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (torchrun's worker, not this process's child: it may linger unreaped, a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fault_after_steps(launcher, run, sig) -> tuple[int, float, str]:
    """Wait for a few logged steps, send ``sig`` to rank 1, then wait for the launch to end: (rank, seconds, output)."""
    metrics, deadline = run / "metrics.jsonl", time.time() + 240
    try:
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"loss"') >= 4):
            time.sleep(0.1)
        workers = _workers(launcher.pid)
        victim = next(p for p in workers if _rank_of([p]) == 1)
        os.kill(victim, sig)
        sent = time.time()
        if sig == signal.SIGSTOP:
            # torchrun waits out a grace period (30 s) before it kills a stopped worker: once the others have left,
            # having said what the test checks, the test ends the stopped one itself.
            while time.time() < sent + 240 and any(_running(p) for p in workers if p != victim):
                time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
        out, err = launcher.communicate(timeout=guard(240))
        return 1, time.time() - sent, out + err
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_rank_killed_under_one_torchrun_is_named_by_the_survivor(data_dir, corpus_dir, tmp_path):
    """torchrun SIGTERMs the survivor as soon as a rank dies, while it works out which one: the line comes first."""
    run = tmp_path / "run"
    rank, took, output = _fault_after_steps(_launch(data_dir, corpus_dir, run, tmp_path), run, signal.SIGKILL)
    lines = [ln for ln in output.splitlines() if ln.startswith("fitgpt train:")]
    assert len(lines) == 1 and f"lost rank {rank} of 2" in lines[0], output[-3000:]
    for c in ckpt.list_checkpoints(run):
        ckpt.verify_checkpoint(c)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stopped_rank_is_treated_as_a_lost_one(data_dir, corpus_dir, tmp_path):
    """SIGSTOP: no collective fails before --dist-timeout (300 s here); the rank watching it names it once its
    heartbeat has stood still --dist-stall-timeout, and every checkpoint left verifies."""
    run = tmp_path / "run"
    launch = _launch(data_dir, corpus_dir, run, tmp_path, "--dist-stall-timeout", str(STALLED_S))
    rank, took, output = _fault_after_steps(launch, run, signal.SIGSTOP)
    assert f"rank {rank} of 2 stopped answering (no heartbeat for {STALLED_S} s, --dist-stall-timeout" in output, output[-3000:]
    assert output.count("stopped answering (no heartbeat") == 1
    assert took < STALLED_S + 60, took  # torchrun's own teardown of the stopped rank included
    for c in ckpt.list_checkpoints(run):
        ckpt.verify_checkpoint(c)
