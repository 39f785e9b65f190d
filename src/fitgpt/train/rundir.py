"""A run directory belongs to one run: a fresh `fitgpt train` never writes over another run's files."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from fitgpt.train.checkpoint import CKPT_DIR, list_checkpoints, step_of

log = logging.getLogger(__name__)

# What `fitgpt train` writes into a run directory: all that --overwrite may remove, and nothing else.
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "tokenizer.json")
RUN_DIRS = ("tensorboard",)


def existing_run(run_dir: Path) -> list[str]:
    """The files of an earlier run in ``run_dir`` (empty when there is none)."""
    found = [name for name in RUN_FILES if (run_dir / name).exists()]
    found += [f"{CKPT_DIR}/{p.name}" for p in list_checkpoints(run_dir)]
    return found


def prepare_run_dir(run_dir: Path, resume: str | None, overwrite: bool) -> None:
    """Refuse to start a fresh run over an earlier one, unless told to start over (then remove only what it wrote)."""
    root = run_dir / CKPT_DIR
    strays = [p for p in root.iterdir() if step_of(p) is not None and not p.is_dir()] if root.is_dir() else []
    if strays:
        raise ValueError(f"{strays[0]} is named like a checkpoint but is not one (a file); move it out of {root}")
    found = existing_run(run_dir)
    if not found or resume:
        return
    if not overwrite:
        ckpts = [f for f in found if f.startswith(CKPT_DIR)]
        what = f"{len(ckpts)} checkpoint(s) up to {ckpts[-1]}" if ckpts else ", ".join(found)
        raise ValueError(f"{run_dir} already holds a run ({what}); continue it with --resume latest, or start over with "
                         "--overwrite (removes that run's checkpoints, metrics and config) or another --out-dir")
    removed = []
    for name in RUN_FILES:
        if (run_dir / name).is_file():
            (run_dir / name).unlink()
            removed.append(name)
    for name in RUN_DIRS:
        if (run_dir / name).is_dir():
            shutil.rmtree(run_dir / name)
            removed.append(name + "/")
    for path in [*list_checkpoints(run_dir), *root.glob(".tmp_step_*")]:
        shutil.rmtree(path)
        removed.append(f"{CKPT_DIR}/{path.name}")
    log.warning("--overwrite: removed the earlier run's %s from %s", ", ".join(removed), run_dir)
