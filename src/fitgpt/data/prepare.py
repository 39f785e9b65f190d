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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from tqdm.auto import tqdm

from fitgpt.data.corpus import BUILTIN, CorpusStats, Document, changed_inputs, list_inputs, read_documents, text_bytes
from fitgpt.data.shards import SPLITS, ShardWriter, StaleProgress, load_progress, save_progress, shard_name
from fitgpt.data.tokenizer import TOKENIZER_FILE, Tokenizer, gpt2_tokenizer, train_bpe
from fitgpt.errors import require_finite, user_errors
from fitgpt.memory.units import format_bytes, parse_bytes
from fitgpt.utils import DirLock, sha256_file, write_error

log = logging.getLogger(__name__)

META_FILE = "meta.json"
FORMAT_VERSION = 2
PARTIAL = ".partial"
LEGACY_FILES = ("train.bin", "val.bin")  # format 1: one file per split
MAX_VOCAB = 1 << 20
"""The largest BPE vocabulary fitgpt trains (today's largest models use about 256k); the BPE trainer allocates
for the size asked, so a typo of 999999999 would ask for tens of GB."""


@dataclass
class DataConfig:
    """Where the token data lives, and how to make it if it is not there yet."""

    dir: Optional[str] = None
    """Prepared data directory (token shards, meta.json, tokenizer.json); default data/<inputs>-<tokenizer><vocab>."""
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
    """bpe: train on at most this much text, each document kept with probability sample/corpus by a seeded draw
    (spread evenly across all inputs), so that training the tokenizer does not grow with the corpus."""
    val_fraction: float = 0.05
    """Share of the documents held out for validation, each drawn by a seeded hash of its name (a corpus of too
    few documents to draw any holds out this share of its last tokens instead)."""
    seed: int = 1337
    """Seed of the train/val draw and of the tokenizer sample."""
    shard_tokens: int = 100_000_000
    """Tokens per output shard: a shard closes at the first document end past this, and a resumed preparation
    starts again from the last closed one."""

    @user_errors
    def __post_init__(self) -> None:
        require_finite(self, "data.")
        if not 0.0 < self.val_fraction < 0.5:
            raise ValueError(f"data.val_fraction must be in (0, 0.5), got {self.val_fraction} (set --data.val-fraction)")
        if self.tokenizer == "bpe" and not 258 <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(f"data.vocab_size must be in [258, {MAX_VOCAB:,}] for bpe, got {self.vocab_size:,} "
                             "(set --data.vocab-size; --vocab-size for fitgpt prepare)")
        if self.tokenizer not in ("bpe", "gpt2") and not Path(self.tokenizer).is_file():
            raise ValueError(f"--tokenizer {self.tokenizer!r}: not bpe, gpt2 or an existing tokenizer.json file")
        if parse_bytes(self.tokenizer_sample, flag="--tokenizer-sample") <= 0:
            raise ValueError("--tokenizer-sample must be positive, e.g. 200MB")
        if self.shard_tokens < 1:
            raise ValueError(f"--shard-tokens must be positive, got {self.shard_tokens}")
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


def is_prepared(directory: Path) -> bool:
    """Whether ``directory`` holds data `fitgpt prepare` wrote: a meta.json in fitgpt's format, or a preparation in
    progress (its staging folder). No other command writes there."""
    try:
        meta = json.loads((directory / META_FILE).read_text())
    except (OSError, ValueError):
        return (directory / PARTIAL).is_dir()
    return isinstance(meta, dict) and "format_version" in meta and "tokenizer_sha256" in meta


def _is_ours(directory: Path) -> bool:
    """A data directory fitgpt prepared, or one whose first preparation was cut off (nothing but fitgpt's lock
    file, its staging folder and temporaries). A run directory is neither."""
    return is_prepared(directory) or all(p.name in (DirLock.FILE, PARTIAL) or p.name.endswith(".tmp")
                                         for p in directory.iterdir())


def _check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--dir {out} is a file; choose a directory (new or empty, or one fitgpt prepared)")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if entries and not _is_ours(out):
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(f"--dir {out} holds files fitgpt did not write ({shown}); prepare into a new or empty --dir")


def _draw(seed: int, purpose: str, source: str) -> float:
    """A uniform number in [0, 1) fixed by the seed, the purpose and the document's name."""
    digest = hashlib.sha256(f"{seed}:{purpose}:{source}".encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2**64


def prepare(cfg: DataConfig, progress: bool = True, resume: bool | None = False) -> dict:
    """Tokenize cfg.inputs into cfg.dir and return the meta dict that was written.

    Writes only into a new or empty directory, or one fitgpt prepared before; holds the directory's lock meanwhile.
    ``resume`` continues an interrupted preparation of the same inputs and settings from its last closed shard
    (and refuses one made otherwise); None continues one if it can and otherwise starts over.
    """
    out = cfg.path
    _check_output_dir(out)
    with DirLock(out, "--dir"):
        try:
            return _prepare(cfg, out, progress, resume)
        except OSError as e:  # a full disk or a read-only folder, at any step
            raise ValueError(f"could not write the prepared data to {out}: {write_error(e, out)}; free disk space, "
                             f"then rerun with --resume (or choose another --dir)") from e


def _prepare(cfg: DataConfig, out: Path, progress: bool, resume: bool | None) -> dict:
    items = list_inputs(list(cfg.inputs))
    part = out / PARTIAL
    if resume and not part.is_dir() and (out / META_FILE).is_file():
        return _complete(cfg, out)
    state = _resumable(cfg, part, items, strict=bool(resume)) if resume is not False else None
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


def _complete(cfg: DataConfig, out: Path) -> dict:
    """--resume on a folder whose preparation finished: nothing to continue. Refused if it was made otherwise than
    asked (it would be replaced); else left as it is."""
    meta = json.loads((out / META_FILE).read_text())
    try:
        check_prepared(cfg, meta, out)
    except ValueError as e:
        raise ValueError(f"--resume: {out} holds a finished preparation, not an interrupted one, and {e}. Without "
                         "--resume it is prepared again and replaced") from None
    log.info("%s holds a finished preparation of these inputs and settings: nothing to resume", out)
    return meta


def _identity(cfg: DataConfig, items: list) -> dict:
    """What must be as it was for a preparation to be resumed."""
    return {"inputs": [str(i) for i in items], "tokenizer": cfg.tokenizer, "vocab_size": cfg.vocab_size,
            "tokenizer_sample": cfg.tokenizer_sample, "text_field": cfg.text_field, "val_fraction": cfg.val_fraction,
            "seed": cfg.seed, "shard_tokens": cfg.shard_tokens}


def _resumable(cfg: DataConfig, part: Path, items: list, strict: bool) -> dict | None:
    """The interrupted preparation's state, if there is one to continue; None to start over. One made with
    other settings or inputs is refused if ``strict``, else started over."""
    loaded = load_progress(part)
    if loaded is None:
        if strict:
            log.info("no interrupted preparation in %s to resume; preparing from the start", part.parent)
        return None
    state, files = loaded
    state["corpus"] = _corpus(files, state.pop("corpus"))
    why = _unlike(state, _identity(cfg, items))
    if why and strict:
        raise ValueError(f"the interrupted preparation in {part.parent} {why}; match it, or rerun without --resume to start over")
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
        log.warning("the interrupted preparation in %s cannot be continued (%s); starting over", part, e)
        return None
    return state


def _corpus(files: list[dict], current: dict | None) -> dict:
    """``CorpusStats`` fields from the journal's finished files and the file being read at the checkpoint."""
    corpus: dict[str, dict] = {"seen": {}, "sha256": {}, "skipped": {}, "records": {}}
    for f in [*files, *([current] if current else [])]:
        for key in corpus:
            if f.get(key) is not None:
                corpus[key][f["path"]] = f[key]
    return corpus


def _file_entry(stats: CorpusStats, path: str) -> dict:
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
            raise ValueError(f"no usable text in {list(cfg.inputs)}: {sample.stats.summary(0, 0)}")
    elif cfg.tokenizer == "gpt2":
        tok = gpt2_tokenizer()
    else:
        tok = Tokenizer.load_file(cfg.tokenizer)
    try:
        tok.save_as(part / TOKENIZER_FILE)
    except Exception as e:  # the tokenizers library's own error for a full disk or a read-only folder
        raise OSError(write_error(e, part)) from e
    state = {
        "identity": _identity(cfg, items), "tokenizer": tok.kind, "tokenizer_sha256": sha256_file(part / TOKENIZER_FILE),
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
            if self.keep < 1 and _draw(self.cfg.seed, "tokenizer-sample", doc.source) >= self.keep:
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
        finished = [_file_entry(stats, str(p)) for p in items[state["files_journaled"] : index] if isinstance(p, Path)]
        state["files_journaled"] = index
        current = items[index] if index < len(items) and position[1] and isinstance(items[index], Path) else None
        state["current_file"] = {"path": str(current), "seen": stats.seen[str(current)],
                                 "records": doc.record_skips if doc else None} if current else None
        save_progress(part, writers, state, finished)

    try:
        docs = read_documents(items, stats, cfg.text_field, tuple(state["position"]))
        for batch, encoded in _encoded(tok, _batches(tok, docs)):
            for doc, pieces in batch:
                split = "val" if _draw(cfg.seed, "val", doc.source) < cfg.val_fraction else "train"
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
        raise ValueError(f"no usable text in {list(cfg.inputs)}: {CorpusStats(**state['corpus']).summary(0, 0)}")
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
        if old.suffix == ".bin" and old.name not in names and (old.name in LEGACY_FILES or old.name.startswith(SPLITS)):
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
        raise ValueError("too little text to hold out any for validation; give `fitgpt prepare` more text")
    pieces = {"train": tokens[:-n_val], "val": tokens[-n_val:]}
    for split in SPLITS:
        name = shard_name(split, len(shards[split]))
        pieces[split].tofile(part / f"{name}.tmp")
        os.replace(part / f"{name}.tmp", part / name)
        shards[split].append({"file": name, "tokens": len(pieces[split])})
    if last["file"] not in {s["file"] for s in shards["train"] + shards["val"]}:
        (part / last["file"]).unlink()
    return shards


def prepared_settings(meta: dict) -> dict:
    """Every DataConfig setting (but the directory) a data directory was prepared with, from its meta.json:
    training adopts each one left at its default and refuses each one given otherwise."""
    settings = {"inputs": tuple(meta.get("inputs") or ()), "tokenizer": meta.get("tokenizer"),
                "text_field": meta.get("text_field", "text")}  # data prepared before record files had no field
    for key in ("val_fraction", "seed", "shard_tokens"):  # data prepared before one was recorded: not compared
        if key in meta:
            settings[key] = meta[key]
    if settings["tokenizer"] == "bpe":
        settings["vocab_size"] = meta.get("requested_vocab_size", meta.get("vocab_size"))
        if "tokenizer_sample" in meta:
            settings["tokenizer_sample"] = meta["tokenizer_sample"]
    return settings


def adopt_prepared(cfg: DataConfig, meta: dict) -> DataConfig:
    """``cfg`` with the settings its data directory was prepared with wherever it leaves them at their defaults and
    names the directory (--data.dir): training on data prepared with `fitgpt prepare` needs only its --dir."""
    if not cfg.dir:
        return cfg
    fields = {f.name: f.default for f in dataclasses.fields(DataConfig)}
    have = prepared_settings(meta)
    if have["tokenizer"] not in ("bpe", "gpt2", None) and not Path(have["tokenizer"]).is_file():
        del have["tokenizer"]  # a tokenizer file since moved: the data's own copy is what trains
    return dataclasses.replace(cfg, **{k: v for k, v in have.items() if v is not None and getattr(cfg, k) == fields[k]})


def ensure_prepared(cfg: DataConfig, progress: bool = True) -> dict:
    """Prepare cfg.dir on first use; if it exists, check it was made as cfg asks, from the inputs as they are now.

    With --data.dir, a setting left at its default is the data's (`adopt_prepared`); one given is checked.
    """
    meta_path = cfg.path / META_FILE
    if not meta_path.is_file():
        if cfg.dir and list(cfg.inputs) == [BUILTIN] and not (cfg.path / PARTIAL).is_dir():
            # Preparing on first use is for the built-in corpus's own folder, or for inputs that were named: a
            # --data.dir alone that holds no data is a typo or a moved folder, not a request for the built-in corpus.
            raise ValueError(f"--data.dir {cfg.dir} holds no prepared data (no {META_FILE}); check the path, prepare it "
                             f"first (fitgpt prepare --dir {cfg.dir} --inputs ...), or name --data.inputs to prepare "
                             "them there on first use")
        log.info("no prepared data in %s; preparing %s now (first use)", cfg.path, list(cfg.inputs))
        return prepare(cfg, progress=progress, resume=None)  # a first use that was interrupted continues
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{meta_path} is unreadable ({e}); re-run `fitgpt prepare --dir {cfg.path}`") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path} is not fitgpt's; re-run `fitgpt prepare --dir {cfg.path}`")
    check_prepared(adopt_prepared(cfg, meta), meta, cfg.path)
    return meta


def check_prepared(cfg: DataConfig, meta: dict, out: Path) -> None:
    """Refuse data prepared otherwise than ``cfg`` asks (a setting, or inputs changed since), naming the flag."""
    meta_path = out / META_FILE
    have = prepared_settings(meta)
    for key in have:
        value = list(getattr(cfg, key)) if key == "inputs" else getattr(cfg, key)
        recorded = list(have[key]) if key == "inputs" else have[key]
        if recorded != value:
            raise ValueError(
                f"{meta_path} was prepared with {key}={recorded!r}, but this run asks for {value!r}; "
                f"use another --data.dir, or match --data.{key.replace('_', '-')}"
            )
    if isinstance(meta.get("files"), dict):
        shas = meta.get("file_sha256") or {s.get("path"): s.get("sha256") for s in meta.get("sources", []) if isinstance(s, dict)}
        changes = changed_inputs(list(cfg.inputs), meta["files"], shas)
        if changes:
            shown = ", ".join(changes[:3]) + (f" and {len(changes) - 3} more" if len(changes) > 3 else "")
            inputs = " ".join(repr(i) if " " in i else i for i in cfg.inputs)
            raise ValueError(
                f"the inputs changed since {cfg.path} was prepared ({shown}); re-prepare with `fitgpt prepare --dir "
                f"{cfg.path} --inputs {inputs}` (runs on the old data keep their tokenizer), or use another --data.dir"
            )
