"""A run directory belongs to one run: a fresh `fitgpt train` never writes over another run's files, nor
over anything fitgpt did not write.

A directory is a run only if fitgpt's marker file says so (or, for runs made before the marker, it holds
fitgpt checkpoints). Anything else that holds files is foreign and is never written into or cleaned,
with or without --overwrite; a prepared data directory is never a run directory.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from fitgpt.data.prepared import is_prepared
from fitgpt.errors import UserError
from fitgpt.train.checkpoint import CKPT_DIR, META_FILE, list_checkpoints, step_of
from fitgpt.utils import DirLock

log = logging.getLogger(__name__)

MARKER = ".fitgpt-run"
"""Written into every run directory when its run starts: what makes a directory a run."""
# What `fitgpt train` writes into a run directory: all that --overwrite may remove, and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "tokenizer.json")
RUN_DIRS = ("tensorboard",)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a fitgpt run directory: its marker, or (runs from before the marker) a checkpoint
    whose meta.json fitgpt wrote."""
    if (path / MARKER).is_file():
        return True
    return any((p / META_FILE).is_file() for p in list_checkpoints(path)) if path.is_dir() else False


def fitgpt_owner(path: Path) -> str | None:
    """What fitgpt keeps at ``path`` or above it (a run, a checkpoint, prepared data), or None: where no
    --out or --overwrite of another command may write."""
    path = path.resolve()
    for p in (path, *path.parents):
        if is_run_dir(p):
            return f"the run directory {p}"
        if is_prepared(p):
            return f"the prepared data directory {p}"
        if step_of(p) is not None and (p / META_FILE).is_file():
            return f"the checkpoint {p}"
    return None


def _trained(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` trained any step (a checkpoint, or a metrics line): then it is kept."""
    metrics = run_dir / "metrics.jsonl"
    return bool(list_checkpoints(run_dir)) or (metrics.is_file() and metrics.stat().st_size > 0)


def _check_not_foreign(run_dir: Path, data_dir: Path | None) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out-dir {run_dir} is a file; choose a directory for the run")
    if (data_dir is not None and run_dir.resolve() == data_dir.resolve()) or is_prepared(run_dir):
        raise UserError(f"--out-dir {run_dir} is a prepared data directory; give the run a directory of its own "
                         "(--out-dir runs/NAME)")
    if is_run_dir(run_dir):
        return
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != DirLock.FILE) if run_dir.is_dir() else []
    if entries:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"--out-dir {run_dir} holds files fitgpt did not write ({shown}); train into a new or empty "
                         "--out-dir (--overwrite only ever removes a fitgpt run's own files)")


def claim_run_dir(run_dir: Path, resume: str | None, overwrite: bool, data_dir: Path | None = None) -> str | None:
    """`prepare_run_dir` for this invocation, with --resume auto decided: 'latest' where the run has a checkpoint
    (every one corrupt is refused there, never removed), else a fresh start that may remove an earlier attempt
    killed before its first checkpoint (its metrics and config: nothing it could continue from). Returns the
    --resume to run with."""
    if resume != "auto":
        prepare_run_dir(run_dir, resume, overwrite, data_dir)
        return resume
    resume = "latest" if run_dir.is_dir() and list_checkpoints(run_dir) else None
    prepare_run_dir(run_dir, resume, resume is None, data_dir, reason="--resume auto (no checkpoint to continue from)")
    log.info("--resume auto: %s", f"continuing the run in {run_dir}" if resume else f"starting the run in {run_dir}")
    return resume


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool, data_dir: Path | None = None,
                    reason: str = "--overwrite") -> None:
    """Refuse to start a fresh run over an earlier one, unless told to start over (then remove only what it wrote,
    saying why: ``reason``), and refuse any directory fitgpt did not make a run. A run that never trained a step
    blocks nothing."""
    root = run_dir / CKPT_DIR
    strays = [p for p in root.iterdir() if step_of(p) is not None and not p.is_dir()] if root.is_dir() else []
    if strays:
        raise UserError(f"{strays[0]} is named like a checkpoint but is not one (a file); move it out of {root}")
    _check_not_foreign(run_dir, data_dir)
    if resume:
        _mark(run_dir)
        return
    trained = is_run_dir(run_dir) and _trained(run_dir)
    if trained and not overwrite:
        ckpts = [f"{CKPT_DIR}/{p.name}" for p in list_checkpoints(run_dir)]
        what = f"{len(ckpts)} checkpoint(s) up to {ckpts[-1]}" if ckpts else "metrics.jsonl"
        raise UserError(f"{run_dir} already holds a run ({what}); continue it with --resume latest, or start over with "
                         "--overwrite (removes that run's checkpoints, metrics and config) or another --out-dir")
    if is_run_dir(run_dir):
        _remove_run(run_dir, why=reason if trained else "a run that never trained a step")
    _mark(run_dir)


def _remove_run(run_dir: Path, why: str) -> None:
    removed = []
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
            removed.append(name)
    for name in RUN_DIRS:
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
            removed.append(name + "/")
    root = run_dir / CKPT_DIR
    for path in [*list_checkpoints(run_dir), *(root.glob(".tmp_step_*") if root.is_dir() else [])]:
        shutil.rmtree(path)
        removed.append(f"{CKPT_DIR}/{path.name}")
    if removed:
        log.warning("%s: removed the earlier run's %s from %s", why, ", ".join(removed), run_dir)


def _mark(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / MARKER).is_file():
        (run_dir / MARKER).write_text(json.dumps({"fitgpt": "run directory", "version": 1}) + "\n")
