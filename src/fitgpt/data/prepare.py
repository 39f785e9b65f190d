"""Text in, token memmaps out: ``train.bin``, ``val.bin``, ``tokenizer.json`` and ``meta.json``."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
from tqdm.auto import tqdm

from fitgpt.data.corpus import BUILTIN, CorpusStats, read_documents
from fitgpt.data.tokenizer import gpt2_tokenizer, train_bpe
from fitgpt.utils import sha256_file

log = logging.getLogger(__name__)

META_FILE = "meta.json"
FORMAT_VERSION = 1


@dataclass
class DataConfig:
    """Where the token data lives, and how to make it if it is not there yet."""

    dir: Optional[str] = None
    """Prepared data directory (train.bin, val.bin, meta.json, tokenizer.json); default data/<inputs>-<tokenizer><vocab>."""
    inputs: tuple[str, ...] = (BUILTIN,)
    """Text files, directories or globs; 'stdlib' is the built-in corpus; 'hf:NAME[#column]' a HF dataset."""
    tokenizer: Literal["bpe", "gpt2"] = "bpe"
    """bpe: train a byte-level BPE on the inputs; gpt2: the GPT-2 vocabulary from local files."""
    vocab_size: int = 2048
    """Vocabulary size of the trained BPE (ignored for gpt2, which has 50257)."""
    val_fraction: float = 0.05
    """Share of the tokens held out for validation (the tail of a seeded shuffle of documents)."""
    seed: int = 1337
    """Seed of the document shuffle that decides the train/val split."""

    def __post_init__(self) -> None:
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction} (set --data.val-fraction)")
        if self.tokenizer == "bpe" and self.vocab_size < 258:
            raise ValueError(f"data.vocab_size must be at least 258 for bpe, got {self.vocab_size} (set --data.vocab-size)")
        if not self.inputs:
            raise ValueError("data.inputs is empty; name at least one file, directory or 'stdlib' (--data.inputs)")

    @property
    def path(self) -> Path:
        """The data directory: as given, or one named after the inputs and tokenizer, so that
        different preparations never overwrite each other."""
        if self.dir:
            return Path(self.dir)
        name = BUILTIN if list(self.inputs) == [BUILTIN] else "custom-" + hashlib.sha256("\0".join(self.inputs).encode()).hexdigest()[:8]
        return Path("data") / (f"{name}-gpt2" if self.tokenizer == "gpt2" else f"{name}-bpe{self.vocab_size}")


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _atomic_write_array(path: Path, arr: np.ndarray) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    arr.tofile(tmp)
    os.replace(tmp, path)


def prepare(cfg: DataConfig, progress: bool = True) -> dict:
    """Tokenize cfg.inputs into cfg.dir and return the meta dict that was written."""
    out = cfg.path
    out.mkdir(parents=True, exist_ok=True)
    stats = CorpusStats()
    docs = list(read_documents(list(cfg.inputs), stats))
    log.info("corpus: %s", stats.summary())
    if not docs:
        raise ValueError(f"no usable text in {list(cfg.inputs)}: {stats.summary()}")
    # A seeded shuffle of whole documents, then the tail is val: deterministic and not biased
    # towards the alphabetically last files.
    order = sorted(range(len(docs)), key=lambda i: hashlib.sha256(f"{cfg.seed}:{docs[i].source}".encode()).digest())
    docs = [docs[i] for i in order]

    if cfg.tokenizer == "bpe":
        tok = train_bpe((d.text for d in docs), cfg.vocab_size)
    else:
        tok = gpt2_tokenizer()
    dtype = token_dtype(tok.vocab_size)
    chunks: list[np.ndarray] = []
    bar = tqdm(total=stats.bytes, unit="B", unit_scale=True, desc="tokenizing", disable=None if progress and stats.bytes >= 1e6 else True)
    for s in range(0, len(docs), 64):
        batch = docs[s : s + 64]
        for ids in tok.encode_batch([d.text for d in batch]):
            ids.append(tok.eot_id)  # end-of-text between documents
            chunks.append(np.asarray(ids, dtype=dtype))
        bar.update(sum(len(d.text.encode()) for d in batch))
    bar.close()
    tokens = np.concatenate(chunks)
    n_val = max(1, int(len(tokens) * cfg.val_fraction))
    train, val = tokens[:-n_val], tokens[-n_val:]
    _atomic_write_array(out / "train.bin", train)
    _atomic_write_array(out / "val.bin", val)
    tok.save(out)
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "tokenizer_sha256": sha256_file(out / "tokenizer.json"),
        "dtype": dtype.name,
        "train_tokens": int(len(train)),
        "val_tokens": int(len(val)),
        "inputs": list(cfg.inputs),
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "documents": stats.documents,
        "skipped": {"binary": len(stats.skipped_binary), "not_utf8": len(stats.skipped_not_utf8), "empty": len(stats.skipped_empty)},
        "sources": [{"path": d.source, "sha256": d.sha256} for d in sorted(docs, key=lambda d: d.source)],
    }
    tmp = out / (META_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / META_FILE)  # meta last: its presence marks a complete preparation
    log.info("wrote %s: %d train / %d val tokens, vocab %d (%s)", out, len(train), len(val), tok.vocab_size, tok.kind)
    return meta


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> dict:
    """Prepare cfg.dir on first use; if it exists, check it was made as cfg asks."""
    meta_path = cfg.path / META_FILE
    if not meta_path.is_file():
        log.info("no prepared data in %s; preparing %s now (first use)", cfg.path, list(cfg.inputs))
        return prepare(cfg, progress=progress)
    meta = json.loads(meta_path.read_text())
    wanted = {"tokenizer": cfg.tokenizer, "inputs": list(cfg.inputs)}
    if cfg.tokenizer == "bpe":
        wanted["vocab_size"] = cfg.vocab_size
    for key, value in wanted.items():
        if meta.get(key) != value:
            raise ValueError(
                f"{meta_path} was prepared with {key}={meta.get(key)!r}, but this run asks for {value!r}; "
                f"use another --data.dir, or match --data.{key.replace('_', '-')}"
            )
    return meta
