"""Crash-safe checkpoints: written to a temporary directory, checksummed, then renamed into place.

A checkpoint is a directory ``step_000100/`` holding ``model.safetensors`` (weights),
``state.pt`` (optimizer, scaler, RNG tensors; loaded with ``weights_only=True``) and ``meta.json``
(step, config, sampler state and a sha256 of each file). ``meta.json`` is written last and the
directory is renamed only when complete, so a process killed mid-save never leaves a checkpoint
that ``latest`` could pick.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_model, save_file, save_model

from fitgpt.utils import sha256_file

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.pt", "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, corrupt, or not ours."""


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (disk full, permissions, I/O error); older ones are untouched."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module | dict, state: dict, meta: dict, keep_last: int) -> Path:
    """Write checkpoint ``step`` atomically, then delete all but the newest ``keep_last``.

    ``model``: the module, or its full weights already gathered (sharded training), tied names left out.
    """
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    # One process writes a run's checkpoints: temporary directories left here were cut off by a crash.
    for stale in root.glob(".tmp_step_*"):
        log.warning("removing %s, a checkpoint whose writing was interrupted", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    try:
        tmp.mkdir()
        if isinstance(model, dict):
            save_file(model, str(tmp / MODEL_FILE))
        else:
            save_model(model, str(tmp / MODEL_FILE))
        torch.save(state, tmp / STATE_FILE)
        files = {name: {"sha256": sha256_file(tmp / name), "bytes": (tmp / name).stat().st_size} for name in (MODEL_FILE, STATE_FILE)}
        with open(tmp / META_FILE, "w") as f:
            json.dump({**meta, "step": step, "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        for name in (MODEL_FILE, STATE_FILE):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        good = list_checkpoints(run_dir)
        raise CheckpointSaveError(
            e.errno, f"could not write checkpoint step {step} to {root}: {e.strerror or e}. Nothing older was touched "
            f"(newest intact: {good[-1] if good else 'none'}). Free disk space or use another --out-dir, then resume "
            "with --resume latest"
        ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories, oldest first (temporary directories are never listed)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's meta, after checking every file against the sizes and hashes it records."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is incomplete or not a fitgpt checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
        files = meta["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    for name in (MODEL_FILE, STATE_FILE):
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        rec = files.get(name, {})
        if f.stat().st_size != rec.get("bytes"):
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, {meta_path} records {rec.get('bytes')}: truncated or replaced")
        if sha256_file(f) != rec.get("sha256"):
            raise CheckpointError(f"{f} does not match the sha256 in {meta_path}: the file is corrupt")
    return meta


def resolve_resume(run_dir: Path, resume: str) -> tuple[Path, dict]:
    """The checkpoint to resume from: ``latest`` falls back past corrupt ones, saying so."""
    if resume != "latest":
        return Path(resume), verify_checkpoint(Path(resume))
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(f"--resume latest: no checkpoint in {Path(run_dir) / CKPT_DIR}")
    for path in reversed(candidates):
        try:
            return path, verify_checkpoint(path)
        except CheckpointError as e:
            log.warning("skipping bad checkpoint: %s", e)
    raise CheckpointError(f"--resume latest: every checkpoint in {Path(run_dir) / CKPT_DIR} is corrupt")


def load_weights(path: Path, model: nn.Module) -> None:
    try:
        missing, unexpected = load_model(model, str(Path(path) / MODEL_FILE), strict=False)
    except Exception as e:  # safetensors raises several types for a bad file or a shape mismatch
        raise CheckpointError(f"{Path(path) / MODEL_FILE} does not fit this model: {e}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{Path(path) / MODEL_FILE} does not fit this model: missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )


def load_state(path: Path) -> dict:
    f = Path(path) / STATE_FILE
    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{f} holds objects other than tensors and plain data; refusing to load it ({e})") from None
