"""Where training text comes from: files, directories, globs, the built-in corpus, or a HF dataset.

Files are one document each, except record files, whose records are documents: JSON Lines (``.jsonl``,
``.jsonl.gz``, read as a stream), a ``.json`` array of objects, and Parquet (``.parquet``, read a row
group at a time with pyarrow, the ``[parquet]`` extra); the text is each record's ``text_field``.

The built-in corpus is the source of the running Python's standard library (about 12 MB of real code
and English docstrings): it is on every machine that runs fitgpt, so the first run needs no download.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fitgpt.utils import sha256_file

log = logging.getLogger(__name__)

BUILTIN = "stdlib"
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class Document:
    source: str
    text: str
    sha256: str


@dataclass
class CorpusStats:
    files: int = 0
    documents: int = 0
    bytes: int = 0
    skipped_binary: list[str] = field(default_factory=list)
    skipped_not_utf8: list[str] = field(default_factory=list)
    skipped_empty: list[str] = field(default_factory=list)
    seen: dict[str, list[int]] = field(default_factory=dict)
    """Every input file read, with its [size, mtime_ns]: what `ensure_prepared` compares to notice changed inputs."""

    def summary(self) -> str:
        return (
            f"{self.files} files seen, {self.documents} documents used ({self.bytes / 1e6:.1f} MB); skipped "
            f"{len(self.skipped_binary)} binary, {len(self.skipped_not_utf8)} not UTF-8, {len(self.skipped_empty)} empty"
        )


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_")]
    return files


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named by paths, directories (walked) and globs, in a stable order."""
    files: list[Path] = []
    for item in inputs:
        if item == BUILTIN:
            files += stdlib_files()
            continue
        matches = sorted(glob.glob(item, recursive=True)) if glob.has_magic(item) else [item]
        if not matches:
            raise ValueError(f"input {item!r} matches no file (check the --inputs pattern)")
        for m in matches:
            p = Path(m)
            if p.is_dir():
                files += sorted(q for q in p.rglob("*") if q.is_file() and not any(part.startswith(".") for part in q.relative_to(p).parts))
            elif p.is_file():
                files.append(p)
            else:
                raise ValueError(f"input {item!r}: {m} does not exist (check the --inputs path)")
    return files


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def read_documents(inputs: list[str], stats: CorpusStats, text_field: str = "text") -> Iterator[Document]:
    """One document per usable text file or record; binary and non-UTF-8 files are skipped and counted."""
    hf = [i for i in inputs if i.startswith("hf:")]
    if hf:
        yield from _hf_documents(hf, stats)
    for path in expand_inputs([i for i in inputs if not i.startswith("hf:")]):
        stats.files += 1
        st = path.stat()
        stats.seen[str(path)] = [st.st_size, st.st_mtime_ns]
        name = path.name.lower()
        if name.endswith(RECORD_SUFFIXES):
            yield from _record_documents(path, _records(path, text_field), text_field, stats)
            continue
        raw = path.read_bytes()
        if b"\x00" in raw[:8192]:
            stats.skipped_binary.append(str(path))
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            stats.skipped_not_utf8.append(str(path))
            continue
        if not text.strip():
            stats.skipped_empty.append(str(path))
            continue
        records = _json_array(text, text_field) if name.endswith(".json") else None
        if records is not None:  # a .json array of records; any other .json is a text document like any file
            yield from _record_documents(path, records, text_field, stats)
            continue
        stats.documents += 1
        stats.bytes += len(raw)
        yield Document(str(path), text, hashlib.sha256(raw).hexdigest())


def _record_documents(path: Path, records: Iterator[dict], text_field: str, stats: CorpusStats) -> Iterator[Document]:
    """Each record's text a document, named ``path#index``; a file none of whose records has the field is an error."""
    used, keys = 0, None
    for i, record in enumerate(records):
        text = record.get(text_field) if isinstance(record, dict) else None
        if keys is None and isinstance(record, dict):
            keys = sorted(record)
        if not isinstance(text, str) or not text.strip():
            continue
        used += 1
        data = text.encode("utf-8")
        stats.documents += 1
        stats.bytes += len(data)
        yield Document(f"{path}#{i}", text, hashlib.sha256(data).hexdigest())
    if not used:
        have = f"its records have: {', '.join(keys)}" if keys else "it has no records"
        raise ValueError(f"{path}: no record has a text field {text_field!r} ({have}); set --text-field "
                         "(--data.text-field when training)")


def _records(path: Path, text_field: str) -> Iterator[dict]:
    if path.name.lower().endswith(".parquet"):
        yield from _parquet_records(path, text_field)
        return
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"{path}:{n}: not a JSON record ({e}); fix or remove the line") from None
    except (OSError, UnicodeDecodeError, EOFError) as e:
        raise ValueError(f"{path}: cannot be read as {'gzip-compressed ' if opener is gzip.open else ''}UTF-8 JSON Lines "
                         f"({e})") from None


def _json_array(text: str, text_field: str) -> list[dict] | None:
    """The records of a .json file holding an array of objects with ``text_field``, else None (a text document)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) and any(text_field in r for r in data):
        return data
    return None


def _parquet_records(path: Path, text_field: str) -> Iterator[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading Parquet needs pyarrow: pip install 'fitgpt[parquet]'") from None
    f = pq.ParquetFile(path)
    columns = f.schema_arrow.names
    if text_field not in columns:
        raise ValueError(f"{path}: no column {text_field!r} (it has: {', '.join(columns)}); set --text-field "
                         "(--data.text-field when training)")
    for batch in f.iter_batches(columns=[text_field], batch_size=1024):  # a bounded slice of a row group at a time
        for text in batch.column(0).to_pylist():
            yield {text_field: text}


def changed_inputs(inputs: list[str], seen: dict[str, list[int]], sha256: dict[str, str]) -> list[str]:
    """The files of ``inputs`` that differ from what a preparation read: new, removed, or with other contents.

    Size and mtime decide cheaply; a file whose mtime alone moved is hashed and passes if its sha256 is unchanged.
    """
    now = {str(p): p for p in expand_inputs([i for i in inputs if not i.startswith("hf:")])}
    changes = [f"{p} (new)" for p in sorted(now.keys() - seen.keys())]
    changes += [f"{p} (removed)" for p in sorted(seen.keys() - now.keys())]
    for name in sorted(now.keys() & seen.keys()):
        st = now[name].stat()
        if [st.st_size, st.st_mtime_ns] == seen[name]:
            continue
        if st.st_size == seen[name][0] and name in sha256 and sha256_file(now[name]) == sha256[name]:
            continue
        changes.append(f"{name} (changed)")
    return changes


def _hf_documents(names: list[str], stats: CorpusStats) -> Iterator[Document]:
    try:
        import datasets
    except ImportError:
        raise ValueError("hf: inputs need the [hf] extra: pip install 'fitgpt[hf]'") from None
    for item in names:
        name, _, column = item[3:].partition("#")
        try:
            ds = datasets.load_dataset(name, split="train")
        except Exception as e:  # network or hub errors: say which input failed and why
            raise ValueError(f"could not load Hugging Face dataset {name!r} (offline?): {e}") from e
        column = column or "text"
        if column not in ds.column_names:
            raise ValueError(f"dataset {name!r} has no column {column!r}; use hf:{name}#COLUMN with one of {ds.column_names}")
        for i, row in enumerate(ds):
            text = row[column]
            stats.files += 1
            if isinstance(text, str) and text.strip():
                stats.documents += 1
                stats.bytes += len(text.encode())
                yield Document(f"hf:{name}[{i}]", text, hashlib.sha256(text.encode()).hexdigest())
