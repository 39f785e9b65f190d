"""Text in, token shards out: ``train_000000.bin``..., ``val_000000.bin``..., ``tokenizer.json`` and ``meta.json``.

Documents stream from the readers through the tokenizer into shards (`fitgpt.data.shards`) in bounded
batches: memory does not grow with the corpus. Everything is staged in ``DIR/.partial`` and moved into
place at the end, ``meta.json`` last, so that ``DIR`` always holds one complete preparation or none,
and an interrupted one resumes (``--resume``) from its last closed shard."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from fitgpt.data.config import DataConfig, tokenizer_file
from fitgpt.data.corpus import CorpusStats, Document, list_inputs, read_documents, text_bytes
from fitgpt.data.prepared import (
    FORMAT_VERSION,
    META_FILE,
    PARTIAL,
    adopt_prepared,
    check_first_use,
    check_output_dir,
    check_prepared,
    read_meta,
)
from fitgpt.data.resume import complete, file_entry, identity, resumable
from fitgpt.data.shards import SPLITS, ShardWriter, save_progress, shard_name
from fitgpt.data.tokenizer import TOKENIZER_FILE, Tokenizer, gpt2_tokenizer, train_bpe
from fitgpt.errors import UserError
from fitgpt.units import format_bytes, parse_bytes
from fitgpt.utils import DirLock, sha256_file, write_error

log = logging.getLogger(__name__)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def _draw(seed: int, purpose: str, text: str) -> float:
    """A uniform number in [0, 1) fixed by the seed, the purpose and the document's text: not its path, so the same
    corpus in another folder (another machine, a copy, a test's temporary folder) splits and samples alike, and a
    document repeated anywhere falls on one side of the split."""
    h = hashlib.sha256(f"{seed}:{purpose}:".encode())
    h.update(text.encode("utf-8", "surrogatepass"))  # a JSON record's text may hold a lone surrogate
    return int.from_bytes(h.digest()[:8], "little") / 2**64


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> tuple[DataConfig, dict]:
    """Prepare cfg.dir on first use; if it exists, check it was made as cfg asks, from the inputs as they are now.
    Returns the settings the data was prepared with and its meta.json.

    With --data.dir, a setting left at its default is the data's (`adopt_prepared`); one given is checked.
    """
    meta = read_meta(cfg)
    if meta is None:
        check_first_use(cfg)
        log.info("no prepared data in %s; preparing %s now (first use)", cfg.path, list(cfg.inputs))
        return cfg, prepare(cfg, progress=progress, resume=None)  # a first use that was interrupted continues
    cfg = adopt_prepared(cfg, meta)
    check_prepared(cfg, meta, cfg.path)
    return cfg, meta


def prepare(cfg: DataConfig, progress: bool = True, resume: bool | None = False) -> dict:
    """Tokenize cfg.inputs into cfg.dir and return the meta dict that was written.

    Writes only into a new or empty directory, or one fitgpt prepared before; holds the directory's lock meanwhile.
    ``resume`` continues an interrupted preparation of the same inputs and settings from its last closed shard
    (and refuses one made otherwise); None continues one if it can and otherwise starts over.
    """
    out = cfg.path
    check_output_dir(out)
    with DirLock(out, "--dir"):
        try:
            return _prepare(cfg, out, progress, resume)
        except OSError as e:  # a full disk or a read-only folder, at any step
            raise UserError(f"could not write the prepared data to {out}: {write_error(e, out)}; free disk space, "
                             f"then rerun with --resume (or choose another --dir)") from e


def _prepare(cfg: DataConfig, out: Path, progress: bool, resume: bool | None) -> dict:
    items = list_inputs(list(cfg.inputs))
    part = out / PARTIAL
    if resume and not part.is_dir() and (out / META_FILE).is_file():
        return complete(cfg, out)
    state = resumable(cfg, part, items, strict=bool(resume)) if resume is not False else None
    if state is None:
        if part.exists():
            log.warning("discarding the interrupted preparation in %s (--resume continues one)", part)
            shutil.rmtree(part)
        part.mkdir(parents=True)
        state = _start(cfg, items, part, progress)
    else:
        log.info("resuming the preparation in %s: %d documents done", part, state["documents"])
    tok = Tokenizer.load(part, state["tokenizer"])
    if not state["done"]:
        _stream(cfg, tok, items, part, state, progress)
    return _finish(cfg, out, part, tok, state)


def _start(cfg: DataConfig, items: list, part: Path, progress: bool) -> dict:
    """A new preparation: the tokenizer made and staged, and its first checkpoint."""
    total = sum(text_bytes(i, cfg.text_field) for i in items)
    sample = None
    if cfg.tokenizer == "bpe":
        limit = parse_bytes(cfg.tokenizer_sample, flag="--tokenizer-sample")
        sample = _Sample(cfg, items, limit, total)
        log.info("training a %d-token byte-level BPE on at most %s of about %s of text", cfg.vocab_size,
                 format_bytes(min(limit, total)), format_bytes(total))
        tok = train_bpe(iter(sample), cfg.vocab_size, progress=progress and min(limit, total) >= 50e6)
        if not sample.documents:
            raise UserError(f"no usable text in {list(cfg.inputs)}: {sample.stats.summary(0, 0)}")
    elif cfg.tokenizer == "gpt2":
        tok = gpt2_tokenizer()
    else:
        tok = Tokenizer.load_file(tokenizer_file(cfg.tokenizer))
    try:
        tok.save_as(part / TOKENIZER_FILE)
    except Exception as e:  # the tokenizers library's own error for a full disk or a read-only folder
        raise OSError(write_error(e, part)) from e
    state = {
        "identity": identity(cfg, items), "tokenizer": tok.kind, "tokenizer_sha256": sha256_file(part / TOKENIZER_FILE),
        "tokenizer_sample_documents": sample.documents if sample else None, "dtype": token_dtype(tok.vocab_size).name,
        "total_bytes": total, "position": [0, 0], "documents": 0, "bytes": 0, "read": 0, "val_documents": 0,
        "corpus": {}, "files_journaled": 0, "done": False,
    }
    save_progress(part, {}, state)
    return state


class _Sample:
    """The documents a BPE trains on: each kept with probability limit/total by a seeded draw, so the sample is
    spread evenly across all inputs, until ``limit`` bytes (at least one document)."""

    def __init__(self, cfg: DataConfig, items: list, limit: int, total: int) -> None:
        self.cfg, self.items, self.limit, self.keep = cfg, items, limit, min(1.0, limit / max(total, 1))
        self.stats, self.documents, self.bytes = CorpusStats(), 0, 0

    def __iter__(self):
        first = None
        for doc in read_documents(self.items, self.stats, self.cfg.text_field):
            first = first or doc
            if self.keep < 1 and _draw(self.cfg.seed, "tokenizer-sample", doc.text) >= self.keep:
                continue
            n = doc.text_bytes
            if self.documents and self.bytes + n > self.limit:
                break
            self.documents, self.bytes = self.documents + 1, self.bytes + n
            yield doc.text
        if first is not None and not self.documents:
            self.documents, self.bytes = 1, first.text_bytes
            yield first.text


def _batches(tok: Tokenizer, docs, batch_chars: int = 4 << 20, batch_docs: int = 256):
    """Documents grouped for one `encode_batch` call (the library uses every core), each with the pieces it is
    encoded in (long documents are cut, `Tokenizer.split_long`), so the encodings in flight stay bounded."""
    batch, size = [], 0
    for doc in docs:
        pieces = tok.split_long(doc.text)
        batch.append((doc, pieces))
        size += len(doc.text)
        if size >= batch_chars or len(batch) >= batch_docs:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(tok: Tokenizer, batches):
    """Each batch with an iterator over its pieces' ids. The next batch encodes in a worker thread (the tokenizer
    releases the GIL and uses every core) while this one is written and the one after is read and parsed."""
    with ThreadPoolExecutor(1) as pool:
        ahead = None
        for batch in batches:
            job = pool.submit(tok.encode_batch, [piece for _, pieces in batch for piece in pieces])
            if ahead is not None:
                yield ahead[0], iter(ahead[1].result())
            ahead = batch, job
        if ahead is not None:
            yield ahead[0], iter(ahead[1].result())


def _stream(cfg: DataConfig, tok: Tokenizer, items: list, part: Path, state: dict, progress: bool) -> None:
    """Every document from ``state['position']`` on, tokenized into the shards of its split; a checkpoint at
    each closed shard, and at the end."""
    dtype = np.dtype(state["dtype"])
    eot = np.asarray([tok.eot_id], dtype=dtype)
    writers = {s: ShardWriter(part, s, dtype, cfg.shard_tokens, **state.get("splits", {}).get(s, {})) for s in SPLITS}
    stats = CorpusStats(**state["corpus"])
    show = progress and state["total_bytes"] >= 1e6
    bar = tqdm(total=state["total_bytes"], initial=state["read"], unit="B", unit_scale=True, desc="tokenizing",
               disable=None if show else True)

    def checkpoint(position: list[int], doc: Document | None = None) -> None:
        """Journal the files read to their end since the last checkpoint; the one being read goes in progress.json
        with the records skipped before ``doc`` (the reader runs ahead of the position: its counts are further on)."""
        index = position[0]
        finished = [file_entry(stats, str(p)) for p in items[state["files_journaled"] : index] if isinstance(p, Path)]
        state["files_journaled"] = index
        current = items[index] if index < len(items) and position[1] and isinstance(items[index], Path) else None
        state["current_file"] = {"path": str(current), "seen": stats.seen[str(current)],
                                 "records": doc.record_skips if doc else None} if current else None
        save_progress(part, writers, state, finished)

    try:
        docs = read_documents(items, stats, cfg.text_field, tuple(state["position"]))
        for batch, encoded in _encoded(tok, _batches(tok, docs)):
            for doc, pieces in batch:
                split = "val" if _draw(cfg.seed, "val", doc.text) < cfg.val_fraction else "train"
                closed = _write_document(writers[split], [next(encoded) for _ in pieces], eot)
                n = doc.text_bytes
                state["documents"] += 1
                state["bytes"] += n
                state["val_documents"] += split == "val"
                state["position"] = list(doc.after)
                state["read"] += doc.size or n
                bar.update(doc.size or n)
                if closed:
                    checkpoint(state["position"], doc)
            bar.set_postfix_str(f"{state['documents']:,} documents", refresh=False)
        for w in writers.values():
            w.close_shard()
        state["done"] = True
        state["position"] = [len(items), 0]
        checkpoint(state["position"])
        state["corpus"] = dataclasses.asdict(stats)
    finally:
        for w in writers.values():
            w.close()
        bar.close()
    records = {p: sum(r.values()) for p, r in stats.records.items() if any(r.values())}
    if records:
        shown = ", ".join(f"{p} ({n})" for p, n in list(records.items())[:3]) + (", ..." if len(records) > 3 else "")
        log.warning("corpus: %s; records without text in %s", stats.summary(state["documents"], state["bytes"]), shown)
    else:
        log.info("corpus: %s", stats.summary(state["documents"], state["bytes"]))


def _write_document(writer: ShardWriter, pieces: list[list[int]], eot: np.ndarray) -> bool:
    """A document's tokens, then end-of-text; True if that closed a shard."""
    for ids in pieces:
        writer.write(np.asarray(ids, dtype=eot.dtype), doc_end=False)
    return writer.write(eot, doc_end=True)


def _finish(cfg: DataConfig, out: Path, part: Path, tok: Tokenizer, state: dict) -> dict:
    """Move the staged preparation into place, meta.json last, and drop what an older one left."""
    shards = {s: list(state["splits"][s]["shards"]) for s in SPLITS}
    if not state["documents"]:
        raise UserError(f"no usable text in {list(cfg.inputs)}: {CorpusStats(**state['corpus']).summary(0, 0)}")
    split = "documents"
    if not shards["train"] or not shards["val"]:
        shards, split = _cut_tail(part, shards, np.dtype(state["dtype"]), cfg.val_fraction), "last tokens"
        log.warning("too few documents for a document-level split: holding out the last %d tokens for validation",
                    shards["val"][-1]["tokens"])
    corpus = CorpusStats(**state["corpus"])
    meta = {
        "format_version": FORMAT_VERSION,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        # What was asked for: a small corpus can give a BPE fewer tokens, and the next run asks again.
        "requested_vocab_size": cfg.vocab_size if cfg.tokenizer == "bpe" else None,
        "tokenizer_sample_documents": state["tokenizer_sample_documents"],
        "eot_id": tok.eot_id,
        "tokenizer_sha256": state["tokenizer_sha256"],
        "dtype": state["dtype"],
        "shards": shards,
        "shard_tokens": cfg.shard_tokens,
        "train_tokens": sum(s["tokens"] for s in shards["train"]),
        "val_tokens": sum(s["tokens"] for s in shards["val"]),
        "split": split,
        "inputs": list(cfg.inputs),
        "text_field": cfg.text_field,
        "val_fraction": cfg.val_fraction,
        "seed": cfg.seed,
        "documents": state["documents"],
        "val_documents": state["val_documents"],
        "bytes": state["bytes"],
        "skipped": corpus.skipped_counts(),
        "files": corpus.seen,
        "file_sha256": corpus.sha256,
        "tokenizer_sample": cfg.tokenizer_sample,
    }
    names = [s["file"] for split_shards in shards.values() for s in split_shards]
    (out / META_FILE).unlink(missing_ok=True)  # no moment where an old meta describes new files
    for name in (*names, TOKENIZER_FILE):
        os.replace(part / name, out / name)
    for old in out.iterdir():  # an older preparation's shards
        if old.suffix == ".bin" and old.name not in names and old.name.startswith(SPLITS):
            old.unlink()
    tmp = out / f"{META_FILE}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / META_FILE)  # meta last: its presence marks a complete preparation
    shutil.rmtree(part)
    log.info("wrote %s: %d train / %d val tokens in %d shards, vocab %d (%s)", out, meta["train_tokens"],
             meta["val_tokens"], len(names), tok.vocab_size, tok.kind)
    return meta


def _cut_tail(part: Path, shards: dict, dtype: np.dtype, val_fraction: float) -> dict:
    """Train and val from a corpus whose documents all fell on one side: the last shard cut, its tail val."""
    side = "train" if shards["train"] else "val"
    last = shards[side].pop()
    tokens = np.fromfile(part / last["file"], dtype=dtype)
    total = last["tokens"] + sum(s["tokens"] for s in shards[side])
    n_val = min(max(1, int(total * val_fraction)), len(tokens) // 2)
    if n_val < 1:
        raise UserError("too little text to hold out any for validation; give `fitgpt prepare` more text")
    pieces = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    for split in SPLITS:
        name = shard_name(split, len(shards[split]))
        pieces[split].tofile(part / f"{name}.tmp")
        os.replace(part / f"{name}.tmp", part / name)
        shards[split].append({"file": name, "tokens": len(pieces[split])})
    if last["file"] not in {s["file"] for s in shards["train"] + shards["val"]}:
        (part / last["file"]).unlink()
    return shards


