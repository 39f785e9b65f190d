"""Checkpoint files on disk (`fitgpt.train.checkpoint`): atomic, checksummed, ordered by step number, verified
on load, and a damaged one skipped for the newest intact one. Kills during a save are in test_faults.py."""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from fitgpt.cli import main
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.loop import TrainingError
from fitgpt.train.trainer import train


def tiny_checkpoint(run, step, keep_last=10):
    meta = {"config": {"model": {}}, "sampler": {"state": 0}}
    state = {"optimizer": {"state": {}, "param_groups": []}, "scaler": {}, "rng": {"torch": torch.get_rng_state()}}
    return ckpt.save_checkpoint(run, step, {"w": torch.full((2,), float(step))}, state, meta, keep_last)


def rewrite(path, name, data):
    """Replace one file of a checkpoint and record its new hash, as a buggy writer would have."""
    (path / name).write_bytes(data) if isinstance(data, bytes) else torch.save(data, path / name)
    meta = json.loads((path / ckpt.META_FILE).read_text())
    meta["files"][name] = {"sha256": ckpt.sha256_file(path / name), "bytes": (path / name).stat().st_size}
    (path / ckpt.META_FILE).write_text(json.dumps(meta))


def test_checkpoints_past_step_999999_sort_by_number_and_keep_last_keeps_the_newest(tmp_path):
    run = tmp_path / "run"
    for step in (999_980, 999_990, 1_000_000, 1_000_010):
        tiny_checkpoint(run, step, keep_last=2)
    assert [ckpt.step_of(p) for p in ckpt.list_checkpoints(run)] == [1_000_000, 1_000_010]
    path, meta = ckpt.resolve_resume(run, "latest")
    assert meta["step"] == 1_000_010 and ckpt.step_of(path) == 1_000_010
    # Names still sort for people (fixed width) well past a million steps.
    assert sorted(p.name for p in ckpt.list_checkpoints(run)) == [p.name for p in ckpt.list_checkpoints(run)]


def test_old_six_digit_names_are_read_and_a_name_that_disagrees_with_meta_is_corrupt(tmp_path):
    run = tmp_path / "run"
    new = tiny_checkpoint(run, 12)
    old = new.parent / "step_000012"
    new.rename(old)
    assert ckpt.resolve_resume(run, "latest")[1]["step"] == 12
    old.rename(old.parent / "step_000013")
    with pytest.raises(ckpt.CheckpointError, match="records step 12, but the directory is named for step 13"):
        ckpt.verify_checkpoint(old.parent / "step_000013")


def test_leftover_temps_of_a_live_writer_are_kept_and_a_dead_one_s_removed(tmp_path):
    run = tmp_path / "run"
    root = run / "checkpoints"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        (root / f".tmp_step_00000009_{live.pid}").mkdir(parents=True)
        (root / f".tmp_step_00000008_{dead.pid}").mkdir()
        tiny_checkpoint(run, 10)
        assert sorted(p.name for p in root.glob(".tmp_*")) == [f".tmp_step_00000009_{live.pid}"]
    finally:
        live.kill()
        live.wait()


def test_a_real_full_disk_during_a_checkpoint_is_a_clear_error(make_cfg, tmp_path, tmpfs):
    probe = tmp_path / "probe"
    train(make_cfg(probe, max_steps=3))
    size = sum(f.stat().st_size for f in (probe / "checkpoints" / "step_00000003").iterdir())
    fs = tmpfs("8m")
    (fs / "filler").write_bytes(b"\0" * (8 * 2**20 - int(1.6 * size) - 64 * 1024))  # room for one checkpoint, not two
    run = fs / "run"
    with pytest.raises(TrainingError, match=r"could not write checkpoint step 6 .*(No space left|no space left).*step_00000003"):
        train(make_cfg(run, max_steps=9))
    assert [p.name for p in ckpt.list_checkpoints(run)] == ["step_00000003"]
    ckpt.verify_checkpoint(run / "checkpoints" / "step_00000003")
    assert not list((run / "checkpoints").glob(".tmp*"))


@pytest.mark.parametrize("damage", [
    lambda m: m["files"].update({ckpt.MODEL_FILE: None}),
    lambda m: m.pop("sampler"),
    lambda m: m.pop("config"),
    lambda m: m.update(files=None),
    lambda m: m.update(step="6"),
])
def test_meta_with_the_wrong_structure_is_a_corrupt_checkpoint_and_latest_falls_back(make_cfg, tmp_path, damage, capsys):
    run = tmp_path / "run"
    train(make_cfg(run))
    newest = ckpt.list_checkpoints(run)[-1]
    meta = json.loads((newest / ckpt.META_FILE).read_text())
    damage(meta)
    (newest / ckpt.META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="meta.json is corrupt"):
        ckpt.verify_checkpoint(newest)
    assert ckpt.resolve_resume(run, "latest")[0].name == "step_00000003"
    assert main(["generate", "--run", str(run), "--checkpoint", str(newest), "--max-new-tokens", "2"]) == 2
    assert "meta.json is corrupt" in capsys.readouterr().err
    assert train(make_cfg(run, resume="latest", max_steps=7))["steps"] == 7


@pytest.mark.parametrize("damage", ["no optimizer", "wrong shape"])
def test_state_with_a_missing_key_or_wrong_shapes_is_corrupt_and_resume_falls_back(make_cfg, tmp_path, damage, caplog):
    run = tmp_path / "run"
    train(make_cfg(run))
    newest = ckpt.list_checkpoints(run)[-1]
    state = torch.load(newest / ckpt.STATE_FILE, weights_only=True)
    if damage == "no optimizer":
        del state["optimizer"]
    else:
        state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 5)
    rewrite(newest, ckpt.STATE_FILE, state)
    summary = train(make_cfg(run, resume="latest", max_steps=7))
    assert summary["steps"] == 7
    assert "skipping bad checkpoint" in caplog.text and "state.pt is corrupt" in caplog.text


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
        ckpt.load_state(target, {})  # a one-process checkpoint


def test_full_disk_during_save_is_a_clear_error_and_keeps_older_checkpoints(data_dir, corpus_dir, tmp_path, monkeypatch, make_cfg):
    run = tmp_path / "run"
    real, calls = ckpt.torch.save, []

    def full_disk(obj, f, *a, **kw):
        calls.append(f)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", full_disk)
    with pytest.raises(TrainingError, match=r"could not write checkpoint step 6 .*No space left on device.*step_00000003.*--out-dir"):
        train(make_cfg(run, max_steps=9))
    monkeypatch.undo()
    assert [d.name for d in ckpt.list_checkpoints(run)] == ["step_00000003"]
    ckpt.verify_checkpoint(run / "checkpoints" / "step_00000003")
    assert not [d for d in (run / "checkpoints").iterdir() if d.name.startswith(".tmp")]
    summary = train(make_cfg(run, max_steps=9, resume="latest"))
    assert summary["steps"] == 9


def test_truncated_files_and_missing_sidecars_name_the_file_and_latest_falls_back(data_dir, corpus_dir, tmp_path, caplog, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=9, keep_last=3))
    s3, s6, s9 = ckpt.list_checkpoints(run)
    with open(s9 / ckpt.STATE_FILE, "r+b") as f:
        f.truncate(10)
    with pytest.raises(ckpt.CheckpointError, match=r"state.pt has 10 bytes, .*meta.json records .*truncated"):
        ckpt.verify_checkpoint(s9)
    (s6 / ckpt.META_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"step_00000006/meta.json is missing"):
        ckpt.verify_checkpoint(s6)
    path, _ = ckpt.resolve_resume(run, "latest")
    assert path == s3
    assert caplog.text.count("skipping bad checkpoint") == 2
    (s3 / ckpt.MODEL_FILE).unlink()
    with pytest.raises(ckpt.CheckpointError, match="every checkpoint .* is corrupt"):
        ckpt.resolve_resume(run, "latest")
    with pytest.raises(ckpt.CheckpointError, match=r"model.safetensors is missing"):
        train(make_cfg(run, max_steps=12, resume=str(s3)))


def test_a_stray_file_named_like_a_checkpoint_is_named(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step_00000002").write_text("not a checkpoint")
    assert main(cli_train_args(run, steps=2)) == 2
    assert "step_00000002 is named like a checkpoint but is not one" in capsys.readouterr().err
    with pytest.raises(ckpt.CheckpointSaveError, match="step_00000002 is a file, not a checkpoint"):
        tiny_checkpoint(run, 2)
