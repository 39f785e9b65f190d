"""Runs that survive a restart: --resume auto starts a run or continues it, so that every restart of
`torchrun --max-restarts N` can run the same command (issue 36, item 8)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hang import guard
from rank_pool import free_port
from test_distributed import train_flags

from fitgpt.cli import main
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.load import load_run


def _weights(run: Path, step: int) -> dict:
    """A checkpoint's weights, whole, in either layout (one process's file, or torchrun's distributed checkpoint)."""
    return load_run(run, str(run / ckpt.CKPT_DIR / ckpt.checkpoint_name(step)))[0].state_dict()


def test_resume_auto_starts_a_run_then_continues_it_exactly(cli_train_args, tmp_path, capsys):
    straight, auto = tmp_path / "straight", tmp_path / "auto"
    assert main(cli_train_args(straight, steps=4)) == 0
    capsys.readouterr()
    assert main(cli_train_args(auto, steps=2) + ["--resume", "auto"]) == 0  # nothing there: started
    assert "--resume auto: starting the run" in capsys.readouterr().err
    assert main(cli_train_args(auto, steps=4) + ["--resume", "auto"]) == 0  # a checkpoint there: continued
    err = capsys.readouterr().err
    assert "--resume auto: continuing the run" in err and "resumed from" in err
    a, b = _weights(straight, 4), _weights(auto, 4)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_auto_starts_over_a_run_killed_before_its_first_checkpoint(cli_train_args, tmp_path):
    """Its metrics alone (nothing to continue from) do not block the restart, as they block a fresh run."""
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=2)) == 0
    for c in (run / ckpt.CKPT_DIR).iterdir():
        shutil.rmtree(c)
    assert (run / "metrics.jsonl").stat().st_size > 0
    assert main(cli_train_args(run, steps=2)) == 2  # a fresh run is refused: the directory holds a run
    assert main(cli_train_args(run, steps=2) + ["--resume", "auto"]) == 0
    assert json.loads((run / ckpt.CKPT_DIR / "step_00000002" / ckpt.META_FILE).read_text())["step"] == 2


def test_resume_auto_never_removes_a_checkpoint(cli_train_args, tmp_path, capsys):
    """Every checkpoint corrupt: refused as --resume latest is, and each is left where it was."""
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=2)) == 0
    for c in (run / ckpt.CKPT_DIR).iterdir():
        (c / ckpt.MODEL_FILE).write_bytes(b"not safetensors")
    before = sorted(p.name for p in (run / ckpt.CKPT_DIR).iterdir())
    capsys.readouterr()
    assert main(cli_train_args(run, steps=4) + ["--resume", "auto"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert sorted(p.name for p in (run / ckpt.CKPT_DIR).iterdir()) == before


def _workers(parent: int) -> list[int]:
    """The fitgpt processes torchrun started (its children that run fitgpt), from /proc."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if d.name.isdigit() and int(fields[1]) == parent and b"fitgpt" in cmd:
            found.append(int(d.name))
    return sorted(found)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds torchrun's workers in /proc")
def test_torchrun_restarts_a_killed_rank_and_the_run_continues_exactly(data_dir, corpus_dir, tmp_path, ranks):
    """`torchrun --max-restarts 1 ... --resume auto`, one rank SIGKILLed after the first checkpoint: torchrun
    restarts the group, which continues from the newest good checkpoint; the final weights equal an
    uninterrupted run's, bitwise."""
    steps = 24
    straight, elastic = tmp_path / "straight", tmp_path / "elastic"
    ranks(2).cli(train_flags(data_dir, corpus_dir, straight, steps))  # the session's ranks, as torchrun starts them
    # The c10d rendezvous, as the README's elastic command: the static one (--master-port) did not restart here.
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", "-m", "fitgpt",
           *train_flags(data_dir, corpus_dir, elastic, steps, "--resume", "auto")]
    log = tmp_path / "elastic.log"
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
        first = elastic / ckpt.CKPT_DIR / "step_00000003" / ckpt.META_FILE
        deadline = time.monotonic() + 240
        while not first.exists():
            assert p.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        workers = _workers(p.pid)
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        p.wait(timeout=guard(400))
    text = log.read_text()
    assert p.returncode == 0, text[-3000:]
    assert "--resume auto: continuing the run" in text and "resumed from" in text, text[-3000:]
    a, b = _weights(straight, steps), _weights(elastic, steps)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_train_checkpoint_and_continue_on_one(data_dir, corpus_dir, tmp_path):
    """Two `torchrun --nnodes 2` launches on this machine stand in for two nodes (c10d rendezvous): they train and
    checkpoint as one run; the same command on one node then continues it (a move from 2 processes to 1)."""
    run = tmp_path / "run"
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "two-nodes"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv, "-m", "fitgpt",
           *train_flags(data_dir, corpus_dir, run, 6, "--resume", "auto")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    errs = [n.communicate(timeout=guard(300))[1] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), errs[0][-2000:] + errs[1][-2000:]
    assert "x 2 processes, ddp" in errs[0] + errs[1]
    assert json.loads((run / ckpt.CKPT_DIR / "step_00000006" / ckpt.META_FILE).read_text())["world_size"] == 2
    one = subprocess.run([sys.executable, "-m", "fitgpt", *train_flags(data_dir, corpus_dir, run, 9, "--resume", "auto")],
                         cwd=tmp_path, capture_output=True, text=True, env=env)
    assert one.returncode == 0 and "the global batch changed (8 windows a step then, 4 now" in one.stderr, one.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_lost_mid_run_stops_the_other_with_one_line_naming_it(data_dir, corpus_dir, tmp_path):
    """Node 2 (its launcher and its rank) killed mid-run: the rank on node 1 names the lost rank in one line, with no
    traceback of its own, well within --dist-timeout; every checkpoint left is whole."""
    run = tmp_path / "run"
    rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{free_port()}", "--rdzv-id", "lost-node"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", *rdzv, "-m", "fitgpt",
           *train_flags(data_dir, corpus_dir, run, 100000, "--checkpoint-interval", "2", "--dist-timeout", "60")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    nodes = []
    for _ in range(2):  # the first launch hosts the rendezvous store (node 1), the second is the node lost
        nodes.append(subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                      start_new_session=True))
        time.sleep(2)
    try:
        metrics = run / "metrics.jsonl"
        deadline = time.time() + 240
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count('"loss"') >= 6):
            time.sleep(0.1)
        survivor, victim = nodes
        lost = _rank_of(_workers(victim.pid))
        for pid in [*_workers(victim.pid), victim.pid]:
            os.kill(pid, signal.SIGKILL)
        killed = time.time()
        out, err = survivor.communicate(timeout=guard(120))
        took = time.time() - killed
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    assert survivor.returncode != 0
    lines = [ln for ln in out.splitlines() if ln.startswith("fitgpt train:")]
    assert len(lines) == 1 and f"lost rank {lost} of 2" in lines[0] and "--resume auto" in lines[0], out[-2000:] + err[-2000:]
    assert "]: Traceback" not in err and took < 60, (took, err[-3000:])
    for c in ckpt.list_checkpoints(run):
        ckpt.verify_checkpoint(c)


def _rank_of(workers: list[int]) -> int | None:
    """The RANK torchrun gave the (one) worker in ``workers``."""
    for pid in workers:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        return next(int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK="))
    return None
