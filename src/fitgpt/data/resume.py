"""Resuming an interrupted preparation: what must be as it was (settings, inputs, staged files) for its
journal (`fitgpt.data.shards`) to be continued rather than started over."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from fitgpt.data.config import DataConfig
from fitgpt.data.corpus import CorpusStats
from fitgpt.data.prepared import META_FILE, check_prepared
from fitgpt.data.shards import ShardWriter, StaleProgress, load_progress
from fitgpt.data.tokenizer import TOKENIZER_FILE
from fitgpt.errors import UserError
from fitgpt.utils import sha256_file

log = logging.getLogger(__name__)


def complete(cfg: DataConfig, out: Path) -> dict:
    """--resume on a folder whose preparation finished: nothing to continue. Refused if it was made otherwise than
    asked (it would be replaced); else left as it is."""
    meta = json.loads((out / META_FILE).read_text())
    try:
        check_prepared(cfg, meta, out)
    except UserError as e:
        raise UserError(f"--resume: {out} holds a finished preparation, not an interrupted one, and {e}. Without "
                         "--resume it is prepared again and replaced") from None
    log.info("%s holds a finished preparation of these inputs and settings: nothing to resume", out)
    return meta


SPLIT_DRAWN_BY = "document text"
"""What each document's side of the split is drawn from (`prepare._draw`); before it, the document's absolute path,
which split the same corpus otherwise in another folder: a preparation interrupted then is not continued now."""


def identity(cfg: DataConfig, items: list) -> dict:
    """What must be as it was for a preparation to be resumed."""
    return {"inputs": [str(i) for i in items], "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size,
            "tokenizer_sample": cfg.tokenizer_sample, "text_field": cfg.text_field, "val_fraction": cfg.val_fraction,
            "seed": cfg.seed, "shard_tokens": cfg.shard_tokens, "split_drawn_by": SPLIT_DRAWN_BY}


def resumable(cfg: DataConfig, part: Path, items: list, strict: bool) -> dict | None:
    """The interrupted preparation's state, if there is one to continue; None to start over. One made with
    other settings or inputs, or one that cannot be read back, is refused if ``strict`` (--resume: nothing is
    discarded), else started over."""
    try:
        loaded = load_progress(part)
    except StaleProgress as e:
        return _cannot_continue(part, str(e), strict)
    if loaded is None:
        if strict:
            log.info("no interrupted preparation in %s to resume; preparing from the start", part.parent)
        return None
    state, files = loaded
    state["corpus"] = _corpus(files, state.pop("corpus"))
    why = _unlike(state, identity(cfg, items))
    if why and strict:
        raise UserError(f"the interrupted preparation in {part.parent} {why}; match it, or rerun without --resume to start over")
    if why:
        log.warning("the interrupted preparation in %s %s; starting over", part.parent, why)
        return None
    try:
        if sha256_file(part / TOKENIZER_FILE) != state["tokenizer_sha256"]:
            raise StaleProgress("its tokenizer.json changed")
        dtype = np.dtype(state["dtype"])
        for split, s in state["splits"].items():
            ShardWriter(part, split, dtype, cfg.shard_tokens, **s)  # checks the shards' sizes
    except (OSError, StaleProgress) as e:
        return _cannot_continue(part, str(e), strict)
    return state


def _cannot_continue(part: Path, why: str, strict: bool) -> None:
    if strict:
        raise UserError(f"--resume: the interrupted preparation in {part} cannot be continued ({why}); rerun without "
                        "--resume to start it over")
    log.warning("the interrupted preparation in %s cannot be continued (%s); starting over", part, why)
    return None


def _corpus(files: list[dict], current: dict | None) -> dict:
    """``CorpusStats`` fields from the journal's finished files and the file being read at the checkpoint."""
    corpus: dict[str, dict] = {"seen": {}, "sha256": {}, "skipped": {}, "records": {}}
    for f in [*files, *([current] if current else [])]:
        for key in corpus:
            if f.get(key) is not None:
                corpus[key][f["path"]] = f[key]
    return corpus


def file_entry(stats: CorpusStats, path: str) -> dict:
    """What reading found in one input file, read to its end: a journal entry."""
    return {"path": path, "seen": stats.seen[path], "sha256": stats.sha256.get(path), "skipped": stats.skipped.get(path),
            "records": stats.records.get(path)}


def _unlike(state: dict, identity: dict) -> str | None:
    """How an interrupted preparation differs from what is asked now, if it does."""
    for key, value in identity.items():
        had = state["identity"].get(key)
        if had != value and key == "inputs":
            return f"read other inputs ({len(had or [])} files and datasets then, {len(value)} now)"
        if had != value:
            return f"was made with other {key} ({had!r}, now {value!r})"
    for path, (size, mtime) in state["corpus"]["seen"].items():
        st = Path(path).stat() if Path(path).is_file() else None
        if st is None or [st.st_size, st.st_mtime_ns] != [size, mtime]:
            return f"read {path}, which has changed since"
    return None
