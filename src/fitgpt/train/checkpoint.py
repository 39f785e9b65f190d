"""Crash-safe checkpoints: written to a temporary directory, checksummed, then renamed into place.

A checkpoint is a directory ``step_00000100/`` in one of two layouts. One process writes ``model.safetensors``
(weights), ``state.pt`` (optimizer, scaler, RNG tensors; loaded with ``weights_only=True``) and ``meta.json``.
DDP and FSDP write a distributed checkpoint (`fitgpt.train.dist_checkpoint`): ``dcp/`` (PyTorch's DCP, each rank's
shards of the weights and optimizer state in its own ``__R_0.distcp`` file, and ``.metadata``),
``train_state.pt`` (scaler, every rank's RNG) and ``meta.json``. ``meta.json`` (step, config, sampler states, a
sha256 and size of every file) is written last and the directory is renamed only when complete, so a process
killed mid-save never leaves a checkpoint that ``latest`` could pick. Checkpoints are ordered by the step number in
their names (checked against ``meta.json``), never by text, so step 1,000,000 sorts after step 999,999.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.nn as nn
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file, save_model

from fitgpt.errors import CheckpointError
from fitgpt.parallel.placement import assign_whole
from fitgpt.utils import pid_alive, sha256_file, write_error

log = logging.getLogger(__name__)

CKPT_DIR = "checkpoints"
MODEL_FILE, STATE_FILE, META_FILE = "model.safetensors", "state.pt", "meta.json"
# The distributed layout: DCP's directory, and what is not sharded (the scaler, and each rank's RNG).
DCP_DIR, TRAIN_STATE_FILE, DCP_FORMAT = "dcp", "train_state.pt", "dcp"
# Eight digits sort for people up to step 99,999,999; ordering itself always uses the number.
_NAME = re.compile(r"step_(\d+)")
_TMP = re.compile(r"\.tmp_step_\d+_(\d+)")
T = TypeVar("T")


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


def tied_names(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names the weight file leaves out because another name holds the same tensor (a tied head).

    Of each group sharing one storage the file keeps the first name in sorted order, as ``save_model``
    does, so weights gathered by name (FSDP) and written with ``save_file`` give the same file.
    """
    groups: dict[tuple, list[str]] = {}
    for name, t in state_dict.items():
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        groups.setdefault(key, []).append(name)
    return sorted(name for names in groups.values() for name in sorted(names)[1:])


def tied_parameter_names(model: nn.Module) -> list[str]:
    """``tied_names`` of the model's weights, read from which of its state dict's tensors are one object: so also of
    a model on the meta device (built to be sharded), whose tensors have no storage to compare, and under the names
    a checkpoint uses whatever wraps the blocks."""
    groups: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(name)
    return sorted(name for names in groups.values() for name in sorted(names)[1:])


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint directory's name says, or None for a name that is not a checkpoint's."""
    m = _NAME.fullmatch(Path(path).name)
    return int(m.group(1)) if m else None


def _remove_dead_temps(root: Path) -> None:
    """Temporary directories whose writer is dead were cut off by a crash; a live writer's are left alone."""
    for stale in root.glob(".tmp_step_*"):
        m = _TMP.fullmatch(stale.name)
        pid = int(m.group(1)) if m else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            log.warning("leaving %s: its writer (pid %d) is still running", stale, pid)
            continue
        log.warning("removing %s, a checkpoint whose writing was interrupted", stale)
        shutil.rmtree(stale, ignore_errors=True)


def file_records(directory: Path, names: list[str]) -> dict[str, dict]:
    """Each file's sha256 and size, for meta.json, once it is on disk for good (fsynced)."""
    records = {}
    for name in names:
        with open(directory / name, "rb") as f:
            os.fsync(f.fileno())
        records[name] = {"sha256": sha256_file(directory / name), "bytes": (directory / name).stat().st_size}
    return records


def write_meta(tmp: Path, meta: dict, step: int, files: dict[str, dict]) -> None:
    """meta.json, the last file a checkpoint gets: without it a directory is never taken for a checkpoint."""
    with open(tmp / META_FILE, "w") as f:
        json.dump({**meta, "step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write(tmp: Path, model: nn.Module | dict, state: dict, meta: dict, step: int) -> None:
    tmp.mkdir()
    if isinstance(model, dict):
        save_file(model, str(tmp / MODEL_FILE))
    else:
        save_model(model, str(tmp / MODEL_FILE))
    torch.save(state, tmp / STATE_FILE)
    write_meta(tmp, meta, step, file_records(tmp, [MODEL_FILE, STATE_FILE]))


def temp_dir(run_dir: Path, step: int) -> tuple[Path, Path]:
    """(where checkpoint ``step`` is written, where it goes once complete); temporary directories left by dead writers
    are removed."""
    root = Path(run_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    if final.exists() and not final.is_dir():
        raise CheckpointSaveError(errno.EEXIST, f"{final} is a file, not a checkpoint, and stands where checkpoint step {step} "
                                  "goes; move it out of the run directory, then resume with --resume latest")
    _remove_dead_temps(root)
    return root / f".tmp_step_{step:08d}_{os.getpid()}", final


def publish(tmp: Path, final: Path) -> None:
    """The complete checkpoint renamed into place (a step saved again replaces the older one)."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def save_failed(e: BaseException, run_dir: Path, step: int) -> CheckpointSaveError:
    """The one-line error of a write that failed: what, why, and that nothing older was touched."""
    root = Path(run_dir) / CKPT_DIR
    good = list_checkpoints(run_dir)
    return CheckpointSaveError(
        getattr(e, "errno", None) or errno.EIO, f"could not write checkpoint step {step} to {root}: {write_error(e, root)}. "
        f"Nothing older was touched (newest intact: {good[-1] if good else 'none'}). Free disk space or use another "
        "--out-dir, then resume with --resume latest")


def prune(run_dir: Path, step: int, keep_last: int) -> None:
    """Delete all but the newest ``keep_last``: checkpoint ``step`` and the ones before it stay, nothing newer than it
    is ever deleted here."""
    older = [p for p in list_checkpoints(run_dir) if step_of(p) < step]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(run_dir: Path, step: int, model: nn.Module | dict, state: dict, meta: dict, keep_last: int) -> Path:
    """Write checkpoint ``step`` atomically, then delete all but the newest ``keep_last``.

    ``model``: the module, or its full weights already gathered, tied names left out.
    """
    tmp, final = temp_dir(run_dir, step)
    try:
        _write(tmp, model, state, meta, step)
        publish(tmp, final)
    except (OSError, RuntimeError, SafetensorError) as e:
        # torch.save reports a full disk as a RuntimeError from its zip writer, safetensors as its own error.
        shutil.rmtree(tmp, ignore_errors=True)
        raise save_failed(e, run_dir, step) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(run_dir, step, keep_last)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint directories, oldest first by step number (temporary directories are never listed)."""
    root = Path(run_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and step_of(p) is not None), key=step_of)


def _check_meta(meta: object, meta_path: Path, path: Path) -> dict:
    """The structure every reader relies on; anything else is a corrupt checkpoint, not a crash."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{meta_path} is corrupt ({what})")

    if not isinstance(meta, dict):
        raise bad("not a JSON object")
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise bad(f"step is {step!r}")
    if step_of(path) is not None and step_of(path) != step:
        raise bad(f"it records step {step}, but the directory is named for step {step_of(path)}")
    files = meta.get("files")
    if not isinstance(files, dict):
        raise bad("no 'files' table")
    if meta.get("format", "safetensors") not in ("safetensors", DCP_FORMAT):
        raise bad(f"format {meta.get('format')!r}, which this fitgpt does not read")
    for name in set(required_files(meta)) | set(files):
        rec = files.get(name)
        if not isinstance(rec, dict) or not isinstance(rec.get("bytes"), int) or not isinstance(rec.get("sha256"), str):
            raise bad(f"no size and sha256 for {name}")
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise bad(f"a file named {name!r}, outside the checkpoint")
    config = meta.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise bad("no model config")
    if not isinstance(meta.get("sampler"), dict):
        raise bad("no sampler state")
    for key in ("data",):
        if key in meta and not isinstance(meta[key], dict):
            raise bad(f"'{key}' is not an object")
    return meta


def required_files(meta: dict) -> tuple[str, ...]:
    """The files a checkpoint of ``meta``'s layout cannot be read without (its DCP shards are listed in meta.json)."""
    return (f"{DCP_DIR}/.metadata", TRAIN_STATE_FILE) if layout(meta) == DCP_FORMAT else (MODEL_FILE, STATE_FILE)


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's meta, after checking its structure and every file against the sizes and hashes it records."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} is incomplete or not a fitgpt checkpoint")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    files = _check_meta(meta, meta_path, path)["files"]
    for name in files:
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing")
        rec = files[name]
        if f.stat().st_size != rec["bytes"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, {meta_path} records {rec['bytes']}: truncated or replaced")
        if sha256_file(f) != rec["sha256"]:
            raise CheckpointError(f"{f} does not match the sha256 in {meta_path}: the file is corrupt")
    return meta


def resolve_resume(run_dir: Path, resume: str, load: Callable[[Path], T] = verify_checkpoint, flag: str = "--resume") -> tuple[Path, T]:
    """The checkpoint to resume from and what ``load`` made of it; ``latest`` falls back past corrupt ones, saying so.

    ``load`` raises CheckpointError for a checkpoint it cannot use (by default: verify files and structure).
    """
    if resume != "latest":
        path = Path(resume)
        if not path.is_dir():
            raise CheckpointError(f"{flag} {resume}: no such checkpoint directory (use latest, or a checkpoints/step_* directory)")
        return path, load(path)
    candidates = list_checkpoints(run_dir)
    if not candidates:
        raise CheckpointError(f"{flag} latest: no checkpoint in {Path(run_dir) / CKPT_DIR}")
    for path in reversed(candidates):
        try:
            return path, load(path)
        except CheckpointError as e:
            log.warning("skipping bad checkpoint: %s", e)
    raise CheckpointError(f"{flag} latest: every checkpoint in {Path(run_dir) / CKPT_DIR} is corrupt")


def layout(meta: dict) -> str:
    """A checkpoint's layout, as its meta.json says: the one place that decides it. Which files happen to be in the
    directory never does: a stray ``model.safetensors`` in a distributed checkpoint is not read."""
    return DCP_FORMAT if meta.get("format") == DCP_FORMAT else "safetensors"


def load_weights(path: Path, model: nn.Module, meta: dict | None = None) -> None:
    """The checkpoint's weights into ``model``: whole, or under FSDP into this rank's shards (the model is never whole
    on a rank), from the layout its ``meta`` (verified here if not given) records. A tied name the checkpoint leaves
    out is filled through the name it keeps. Under torchrun every rank calls it (reading DCP's shards is a collective)."""
    meta = verify_checkpoint(path) if meta is None else meta
    if layout(meta) == DCP_FORMAT:
        from fitgpt.train import dcp_read

        dcp_read.load_model(Path(path) / DCP_DIR, model_state(model))
        return
    f = Path(path) / MODEL_FILE
    own = model.state_dict(keep_vars=True)  # the tensors themselves, under the names a checkpoint uses
    tied = set(tied_parameter_names(model))
    try:
        with safe_open(str(f), framework="pt") as weights:
            names = set(weights.keys())
            missing = set(own) - names - tied
            unexpected = names - set(own)
            if missing or unexpected:
                raise CheckpointError(f"{f} does not fit this model: missing {sorted(missing)[:5]}, unexpected "
                                      f"{sorted(unexpected)[:5]}")
            for name in sorted(names):
                try:
                    assign_whole(own[name], weights.get_tensor(name))
                except ValueError as e:
                    raise CheckpointError(f"{f} does not fit this model: {name} has {e}") from None
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises several types for a bad file
        raise CheckpointError(f"{f} does not fit this model: {e}") from None


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights a distributed checkpoint holds: the model's state dict (under FSDP, this rank's shards), tied names
    left out as the weight file leaves them."""
    tied = set(tied_parameter_names(model))
    return {k: v for k, v in model.state_dict().items() if k not in tied}


@dataclass(frozen=True)
class SavedOptimizer:
    """A distributed checkpoint's optimizer state, read once the optimizer exists (`dist_checkpoint.load_optimizer`)."""

    path: Path


def load_state(path: Path, meta: dict, param_shapes: list[torch.Size] | None = None) -> dict:
    """The training state, checked for the keys resume reads: ``state.pt`` (with, given the optimizer's parameter
    shapes, the moments' shapes checked), or a distributed checkpoint's ``train_state.pt``, whose optimizer state is
    read from ``dcp/`` once the optimizer exists (DCP checks each shape as it reads).

    The file is memory-mapped, not read: a tensor's bytes come into memory when it is used, once per machine
    (the page cache is shared), so N processes resuming one checkpoint do not each hold the whole optimizer
    state; under FSDP each keeps only its shard."""
    dcp_layout = layout(meta) == DCP_FORMAT
    f = Path(path) / (TRAIN_STATE_FILE if dcp_layout else STATE_FILE)
    try:
        state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{f} holds objects other than tensors and plain data; refusing to load it ({e})") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{f} is unreadable ({str(e).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{f} is corrupt (not a dict)")
    if dcp_layout:
        state["optimizer"] = SavedOptimizer(Path(path))
    else:
        _check_optimizer_state(f, state.get("optimizer"), param_shapes)
    if not isinstance(state.get("scaler"), dict) or not isinstance(state.get("rng"), dict) or "torch" not in state["rng"]:
        raise CheckpointError(f"{f} is corrupt (no scaler or RNG state)")
    return state


def _check_optimizer_state(f: Path, opt: object, param_shapes: list[torch.Size] | None) -> None:
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(f"{f} is corrupt (no optimizer state)")
    if param_shapes is None:
        return
    for i, s in opt["state"].items():
        if not isinstance(i, int) or not 0 <= i < len(param_shapes) or not isinstance(s, dict):
            raise CheckpointError(f"{f} is corrupt (optimizer state for parameter {i!r}, the model has {len(param_shapes)})")
        for key, v in s.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and not _state_shape(v.shape, param_shapes[i]):
                raise CheckpointError(f"{f} is corrupt (optimizer {key} of parameter {i} has shape {tuple(v.shape)}, "
                                      f"the parameter {tuple(param_shapes[i])})")


def _state_shape(state: torch.Size, param: torch.Size) -> bool:
    """A state tensor's shape as an optimizer keeps one for a parameter of shape ``param``: the same, factored
    (Adafactor's row and column means: the same dimensions, some of them 1), or projected (GaLore's and APOLLO's
    low-rank moments and projections, m x r or r x n, sharing a dimension with it, and their 1-D factors)."""
    if state == param or (len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param))):
        return True
    return len(param) == 2 and len(state) in (1, 2) and (len(state) == 1 or any(s in param for s in state))
