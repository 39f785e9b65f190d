"""Text in, token memmaps out: ``train.bin``, ``val.bin``, ``tokenizer.json`` and ``meta.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from fitgpt.data.corpus import BUILTIN, CorpusStats, changed_inputs, read_documents
from fitgpt.data.tokenizer import Tokenizer, gpt2_tokenizer, train_bpe
from fitgpt.memory.units import format_bytes, parse_bytes
from fitgpt.utils import DirLock, sha256_file, write_error

log = logging.getLogger(__name__)

META_FILE = "meta.json"
FORMAT_VERSION = 1
DATA_FILES = ("train.bin", "val.bin", "tokenizer.json")


@dataclass
class DataConfig:
    """Where the token data lives, and how to make it if it is not there yet."""

    dir: Optional[str] = None
    """Prepared data directory (train.bin, val.bin, meta.json, tokenizer.json); default data/<inputs>-<tokenizer><vocab>."""
    inputs: tuple[str, ...] = (BUILTIN,)
    """Text files, directories or globs; .jsonl, .jsonl.gz, .json arrays and .parquet files give one document per
    record; 'stdlib' is the built-in corpus; 'hf:NAME[#column]' a HF dataset."""
    text_field: str = "text"
    """The field (JSON) or column (Parquet) holding each record's text."""
    tokenizer: str = "bpe"
    """bpe: train a byte-level BPE on the inputs; gpt2: the GPT-2 vocabulary from local files; or a tokenizer.json
    to reuse (another data directory's or run's, a Hugging Face folder's; it needs an <|endoftext|> token)."""
    vocab_size: int = 2048
    """Vocabulary size of the trained BPE (ignored for gpt2, which has 50257, and for a tokenizer file)."""
    tokenizer_sample: str = "200MB"
    """bpe: train on at most this much text, documents drawn across all inputs in the seeded order, so that training
    the tokenizer does not grow with the corpus."""
    val_fraction: float = 0.05
    """Share of the tokens held out for validation (the tail of a seeded shuffle of documents)."""
    seed: int = 1337
    """Seed of the document shuffle that decides the train/val split."""

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction} (set --data.val-fraction)")
        if self.tokenizer == "bpe" and self.vocab_size < 258:
            raise ValueError(f"data.vocab_size must be at least 258 for bpe, got {self.vocab_size} (set --data.vocab-size)")
        if self.tokenizer not in ("bpe", "gpt2") and not Path(self.tokenizer).is_file():
            raise ValueError(f"--tokenizer {self.tokenizer!r}: not bpe, gpt2 or an existing tokenizer.json file")
        if parse_bytes(self.tokenizer_sample, flag="--tokenizer-sample") <= 0:
            raise ValueError("--tokenizer-sample must be positive, e.g. 200MB")
        if not self.inputs:
            raise ValueError("data.inputs is empty; name at least one file, directory or 'stdlib' (--data.inputs)")

    @property
    def path(self) -> Path:
        """The data directory: as given, or one named after the inputs and tokenizer, so that
        different preparations never overwrite each other."""
        if self.dir:
            return Path(self.dir)
        name = BUILTIN if list(self.inputs) == [BUILTIN] else "custom-" + hashlib.sha256("\0".join(self.inputs).encode()).hexdigest()[:8]
        if self.tokenizer not in ("bpe", "gpt2"):  # a tokenizer file: named after its contents
            return Path("data") / f"{name}-tok{sha256_file(Path(self.tokenizer))[:8]}"
        return Path("data") / (f"{name}-gpt2" if self.tokenizer == "gpt2" else f"{name}-bpe{self.vocab_size}")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _is_ours(directory: Path) -> bool:
    """A data directory fitgpt prepared (a meta.json in fitgpt's format), or one whose first preparation was
    cut off (nothing but fitgpt's lock file and staged ``*.tmp`` files). A run directory is neither."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        staged = {f"{name}.tmp" for name in (*DATA_FILES, META_FILE)}
        return all(p.name == DirLock.FILE or p.name in staged for p in directory.iterdir())
    return isinstance(meta, dict) and "format_version" in meta and "tokenizer_sha256" in meta


def _check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--dir {out} is a file; choose a directory (new or empty, or one fitgpt prepared)")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not _is_ours(out):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(f"--dir {out} holds files fitgpt did not write ({shown}); prepare into a new or empty --dir")


def _encode(tok, docs: list, dtype: np.dtype, bar, batch_chars: int = 4 << 20) -> np.ndarray:
    """All documents' tokens, each followed by end-of-text. Encoded in batches (the library uses every core) of at
    most ``batch_chars`` characters, long documents in pieces, so the encodings in flight stay bounded."""
    chunks: list[np.ndarray] = []
    eot = np.asarray([tok.eot_id], dtype=dtype)
    batch: list[tuple[str, bool]] = []  # (text, ends a document)

    def flush() -> None:
        for (_, ends), ids in zip(batch, tok.encode_batch([t for t, _ in batch])):
            chunks.append(np.asarray(ids, dtype=dtype))
            if ends:
                chunks.append(eot)  # end-of-text between documents
        bar.update(sum(len(t.encode()) for t, _ in batch))
        batch.clear()

    size = 0
    for d in docs:
        pieces = tok.split_long(d.text)
        for i, piece in enumerate(pieces):
            batch.append((piece, i == len(pieces) - 1))
            size += len(piece)
            if size >= batch_chars or len(batch) >= 256:
                flush()
                size = 0
    flush()
    return np.concatenate(chunks)


def _write_all(out: Path, arrays: dict[str, np.ndarray], tok, meta: dict) -> None:
    """Stage every file as ``*.tmp``, then rename into place, meta.json last: a failure or Ctrl-C at any point
    leaves the previous preparation (or nothing) and no temporary file."""
    tmps = [out / f"{name}.tmp" for name in (*DATA_FILES, META_FILE)]
    try:
        for name, arr in arrays.items():
            arr.tofile(out / f"{name}.tmp")
        tok.save_as(out / "tokenizer.json.tmp")
        meta["tokenizer_sha256"] = sha256_file(out / "tokenizer.json.tmp")
        (out / f"{META_FILE}.tmp").write_text(json.dumps(meta, indent=1))
        (out / META_FILE).unlink(missing_ok=True)  # no moment where an old meta describes new files
        for name in DATA_FILES:
            os.replace(out / f"{name}.tmp", out / name)
        os.replace(out / f"{META_FILE}.tmp", out / META_FILE)  # meta last: its presence marks a complete preparation
    except Exception as e:  # OSError, or the tokenizers library's own error, for a full disk or a read-only folder
        reason = write_error(e, out)
        raise ValueError(f"could not write the prepared data to {out}: {reason}; free disk space or choose another --dir") from e
    finally:
        for t in tmps:
            t.unlink(missing_ok=True)


def prepare(cfg: DataConfig, progress: bool = True) -> dict:
    """Tokenize cfg.inputs into cfg.dir and return the meta dict that was written.

    Writes only into a new or empty directory, or one fitgpt prepared before; holds the directory's lock meanwhile.
    """
    out = cfg.path
    _check_output_dir(out)
    with DirLock(out, "--dir"):
        return _prepare(cfg, out, progress)


def _prepare(cfg: DataConfig, out: Path, progress: bool) -> dict:
    stats = CorpusStats()
    docs = list(read_documents(list(cfg.inputs), stats, cfg.text_field))
    log.info("corpus: %s", stats.summary())
    if not docs:
        raise ValueError(f"no usable text in {list(cfg.inputs)}: {stats.summary()}")
    # A seeded shuffle of whole documents, then the tail is val: deterministic and not biased
    # towards the alphabetically last files.
    order = sorted(range(len(docs)), key=lambda i: hashlib.sha256(f"{cfg.seed}:{docs[i].source}".encode()).digest())
    docs = [docs[i] for i in order]

    show = progress and stats.bytes >= 1e6
    sample = None
    if cfg.tokenizer == "bpe":
        sample, sample_bytes = _sample(docs, parse_bytes(cfg.tokenizer_sample, flag="--tokenizer-sample"))
        log.info("training a %d-token byte-level BPE on %s of %s (%d of %d documents)", cfg.vocab_size,
                 format_bytes(sample_bytes), format_bytes(stats.bytes), len(sample), len(docs))
        tok = train_bpe((d.text for d in sample), cfg.vocab_size, progress=show and sample_bytes >= 50e6)
    elif cfg.tokenizer == "gpt2":
        tok = gpt2_tokenizer()
    else:
        tok = Tokenizer.load_file(cfg.tokenizer)
    dtype = token_dtype(tok.vocab_size)
    bar = tqdm(total=stats.bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None if show else True)
    tokens = _encode(tok, docs, dtype, bar)
    bar.close()
    n_val = max(1, int(len(tokens) * cfg.val_fraction))
    train, val = tokens[:-n_val], tokens[-n_val:]
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        # What was asked for: a small corpus can give a BPE fewer tokens, and the next run asks again.
        "requested_vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "tokenizer_sample_documents": len(sample) if sample is not None else None,
        "eot_id": tok.eot_id,
        "tokenizer_sha256": None,  # set from the file as written
        "dtype": dtype.name,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "inputs": list(cfg.inputs),
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "documents": stats.documents,
        "skipped": {"binary": len(stats.skipped_binary), "not_utf8": len(stats.skipped_not_utf8), "empty": len(stats.skipped_empty)},
        "sources": [{"path": d.source, "sha256": d.sha256} for d in sorted(docs, key=lambda d: d.source)],
        "files": stats.seen,
    }
    _write_all(out, {"train.bin": train, "val.bin": val}, tok, meta)
    log.info("wrote %s: %d train / %d val tokens, vocab %d (%s)", out, len(train), len(val), tok.vocab_size, tok.kind)
    return meta


def _sample(docs: list, limit: int) -> tuple[list, int]:
    """The first documents of the seeded shuffle (every input's documents mixed) up to ``limit`` bytes (at least
    one), and their bytes."""
    out, size = [], 0
    for d in docs:
        n = len(d.text.encode())
        if out and size + n > limit:
            break
        out.append(d)
        size += n
    return out, size


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> dict:
    """Prepare cfg.dir on first use; if it exists, check it was made as cfg asks, from the inputs as they are now."""
    meta_path = cfg.path / META_FILE
    if not meta_path.is_file():
        log.info("no prepared data in %s; preparing %s now (first use)", cfg.path, list(cfg.inputs))
        return prepare(cfg, progress=progress)
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path} is unreadable ({e}); re-run `fitgpt prepare --dir {cfg.path}`") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is not fitgpt's; re-run `fitgpt prepare --dir {cfg.path}`")
    wanted = {"tokenizer": cfg.tokenizer, "inputs": list(cfg.inputs), "text_field": cfg.text_field}
    if cfg.tokenizer == "bpe":
        wanted["vocab_size"] = cfg.vocab_size
    for key, value in wanted.items():
        default = "text" if key == "text_field" else None  # data prepared before record files had the field
        have = meta.get("requested_vocab_size", meta.get(key)) if key == "vocab_size" else meta.get(key, default)
        if have != value:
            raise ValueError(
                f"{meta_path} was prepared with {key}={have!r}, but this run asks for {value!r}; "
                f"use another --data.dir, or match --data.{key.replace('_', '-')}"
            )
    if isinstance(meta.get("files"), dict):
        shas = {s.get("path"): s.get("sha256") for s in meta.get("sources", []) if isinstance(s, dict)}
        changes = changed_inputs(list(cfg.inputs), meta["files"], shas)
        if changes:
            shown = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
            inputs = " ".join(repr(i) if " " in i else i for i in cfg.inputs)
            raise ValueError(
                f"the inputs changed since {cfg.path} was prepared ({shown}); re-prepare with `fitgpt prepare --dir "
                f"{cfg.path} --inputs {inputs}` (runs on the old data keep their tokenizer), or use another --data.dir"
            )
    return meta
