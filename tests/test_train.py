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
from safetensors.torch import load_file

from fitgpt.train import checkpoint as ckpt
from fitgpt.train import train


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


def test_checkpoints_are_verified_and_latest_falls_back(data_dir, corpus_dir, tmp_path, caplog, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, keep_last=2))
    cks = ckpt.list_checkpoints(run)
    assert [p.name for p in cks] == ["step_00000003", "step_00000006"]  # keep_last=2
    meta = json.loads((cks[-1] / "meta.json").read_text())
    assert meta["step"] == 6 and meta["config"]["model"]["n_blocks"] == 2 and "sampler" in meta
    # Flip one byte of the newest weights: loading names the file, latest falls back to step 3.
    data = bytearray((cks[-1] / ckpt.MODEL_FILE).read_bytes())
    data[-1] ^= 0xFF
    (cks[-1] / ckpt.MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors does not match the sha256"):
        ckpt.verify_checkpoint(cks[-1])
    path, _ = ckpt.resolve_resume(run, "latest")
    assert path.name == "step_00000003" and "skipping bad checkpoint" in caplog.text
    # A half-written save (no meta.json) is never taken for a checkpoint.
    (run / "checkpoints" / ".tmp_step_000009_1").mkdir()
    (run / "checkpoints" / "step_00000009").mkdir()
    assert ckpt.resolve_resume(run, "latest")[0].name == "step_00000003"


def test_pickled_code_in_a_checkpoint_is_refused(data_dir, corpus_dir, tmp_path, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    target = ckpt.list_checkpoints(run)[-1]

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"optimizer": Evil()}, target / ckpt.STATE_FILE)
    with pytest.raises(ckpt.CheckpointError, match="refusing to load"):
        ckpt.load_state(target)


def test_resume_with_another_model_shape_is_refused(data_dir, corpus_dir, tmp_path, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    cfg = make_cfg(run, resume="latest", model={"context_length": 32, "n_embed": 64, "n_head": 4, "n_blocks": 2})
    with pytest.raises(ValueError, match="model.n_embed=32"):
        train(cfg)


def _fitgpt(*args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "fitgpt", *args], cwd=cwd, capture_output=True, text=True, timeout=300, **kw)


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
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopped by SIGTERM" in err and "--resume latest" in out
    saved = ckpt.list_checkpoints(tmp_path / "runs/sig")
    assert len(saved) == 1 and 0 < json.loads((saved[0] / "meta.json").read_text())["step"] < 100000
    ckpt.verify_checkpoint(saved[0])


def test_nan_loss_stops_with_a_diagnostic(tmp_path, caplog, make_cfg, nan_model):
    import fitgpt.train.trainer as trainer

    with pytest.raises(trainer.TrainingError, match=r"loss is nan at step 0 \(lr .*grad norm .*last good checkpoint: none"):
        train(make_cfg(tmp_path / "a"))
    with pytest.raises(trainer.TrainingError, match="loss is nan at step 2"):
        train(make_cfg(tmp_path / "b", max_bad_steps=2))
    assert caplog.text.count("skipping bad step") == 2
