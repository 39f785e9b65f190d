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
from safetensors.torch import load_file

from fitgpt.errors import UserError
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.loop import TrainingError
from fitgpt.train.trainer import train


def weights(ckpt_dir: Path) -> dict:
    return load_file(str(ckpt_dir / ckpt.MODEL_FILE))


def losses(run: Path) -> list:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(line)]


@pytest.mark.parametrize("policy", ["none", "block"])
def test_resume_is_bitwise_equal_to_straight_through(data_dir, corpus_dir, tmp_path, policy, make_cfg):
    straight = tmp_path / "straight"
    summary = train(make_cfg(straight, activation_checkpointing=policy))
    assert summary["steps"] == 6 and (straight / "loss.png").is_file()
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    shutil.copy(straight / "metrics.jsonl", resumed / "metrics.jsonl")
    train(make_cfg(resumed, resume="latest", activation_checkpointing=policy))
    a, b = weights(straight / "checkpoints" / "step_00000006"), weights(resumed / "checkpoints" / "step_00000006")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(straight) == losses(resumed)


def test_resume_with_another_model_shape_is_refused(data_dir, corpus_dir, tmp_path, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    cfg = make_cfg(run, resume="latest", model={"context_length": 32, "n_embed": 64, "n_head": 4, "n_blocks": 2})
    with pytest.raises(UserError, match="model.n_embed=32"):
        train(cfg)


def _fitgpt(*args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "fitgpt", *args], cwd=cwd, capture_output=True, text=True, timeout=guard(300), **kw)


TRAIN_FLAGS = ["--model.context-length", "32", "--model.n-embed", "32", "--model.n-blocks", "2", "--batch-size", "4",
               "--eval-interval", "10", "--eval-batches", "2", "--data.vocab-size", "400"]


@pytest.mark.slow
def test_end_to_end_prepare_train_generate(corpus_dir, tmp_path):
    r = _fitgpt("prepare", "--inputs", str(corpus_dir), "--dir", "data/x", "--vocab-size", "400", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout and (tmp_path / "data/x/meta.json").is_file()
    r = _fitgpt("train", "--data.dir", "data/x", "--data.inputs", str(corpus_dir), "--max-steps", "20",
                "--out-dir", "runs/e2e", *TRAIN_FLAGS, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 20 and summary["train_loss"] < 6.0
    assert "activation memory of one micro-batch" in r.stderr
    r = _fitgpt("generate", "--run", "runs/e2e", "--prompt", "def ", "--max-new-tokens", "30", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def ") and len(r.stdout) > 10


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_zero(corpus_dir, tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "fitgpt", "train", "--data.dir", "data/x", "--data.inputs", str(corpus_dir),
           "--max-steps", "100000", "--out-dir", "runs/sig", "--log-interval", "1", *TRAIN_FLAGS]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "runs/sig/metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=guard(120))
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err and "--resume latest" in out
    saved = ckpt.list_checkpoints(tmp_path / "runs/sig")
    assert len(saved) == 1 and 0 < json.loads((saved[0] / "meta.json").read_text())["step"] < 100000
    ckpt.verify_checkpoint(saved[0])


def test_nan_loss_stops_with_a_diagnostic(tmp_path, caplog, make_cfg, nan_model):

    with pytest.raises(TrainingError, match=r"loss is nan at step 0 \(lr .*grad norm .*last good checkpoint: none"):
        train(make_cfg(tmp_path / "a"))
    with pytest.raises(TrainingError, match="loss is nan at step 2"):
        train(make_cfg(tmp_path / "b", max_bad_steps=2))
    assert caplog.text.count("skipping bad step") == 2
