"""Where training text comes from: files, directories, globs, the built-in corpus, or a HF dataset.

Files are one document each, except record files, whose records are documents: JSON Lines (``.jsonl``,
``.jsonl.gz``, read as a stream), a ``.json`` array of objects, and Parquet (``.parquet``, read a row
group at a time with pyarrow, the ``[parquet]`` extra); the text is each record's ``text_field``.

The built-in corpus is the source of the running Python's standard library (about 12 MB of real code
and English docstrings): it is on every machine that runs fitgpt, so the first run needs no download.
"""

from __future__ import annotations

import functools
import glob
import gzip
import hashlib
import json
import logging
import os
import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fitgpt.data.config import BUILTIN
from fitgpt.errors import UserError
from fitgpt.utils import sha256_file

log = logging.getLogger(__name__)

_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}


@dataclass
class Document:
    source: str
    text: str
    after: tuple[int, int]
    """Where reading resumes after this document: (input index, records of that input done)."""
    size: int = 0
    """Input bytes read for it (a file's, a JSON line's and any skipped before it), for progress; 0: its text's."""
    record_skips: dict[str, int] | None = None
    """For a record: the records of its file skipped before it, by reason (what a checkpoint here records)."""

    @property
    def text_bytes(self) -> int:
        """Its text's UTF-8 size (an ASCII text's is its length: ``isascii`` is O(1), encoding is a copy)."""
        return len(self.text) if self.text.isascii() else len(self.text.encode())


@dataclass
class CorpusStats:
    """What reading found, file by file (so that a resumed reading can keep the files before its position)."""

    seen: dict[str, list[int]] = field(default_factory=dict)
    """Every input file read, with its [size, mtime_ns]: what `ensure_prepared` compares to notice changed inputs."""
    sha256: dict[str, str] = field(default_factory=dict)
    """Each input file's sha256, of the bytes as read, once it is read to the end."""
    skipped: dict[str, str] = field(default_factory=dict)
    """File -> why it gave no document: binary, not_utf8 or empty."""
    records: dict[str, dict[str, int]] = field(default_factory=dict)
    """Record file -> how many of its records gave no document, by reason (RECORD_SKIPS)."""

    def skipped_counts(self) -> dict[str, int]:
        files = {why: sum(1 for w in self.skipped.values() if w == why) for why in ("binary", "not_utf8", "empty")}
        return files | {f"records_{why}": sum(r.get(why, 0) for r in self.records.values()) for why in RECORD_SKIPS}

    def summary(self, documents: int, size: int) -> str:
        n = self.skipped_counts()
        text = (f"{len(self.seen)} files seen, {documents} documents used ({size / 1e6:.1f} MB); skipped "
                f"{n['binary']} binary, {n['not_utf8']} not UTF-8, {n['empty']} empty")
        records = [f"{n[f'records_{why}']} {label}" for why, label in RECORD_SKIPS.items() if n[f"records_{why}"]]
        return text + (f"; records without text: {', '.join(records)}" if records else "")


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without tests and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py") and not f.startswith("test_")]
    return files


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files named by paths, directories (walked) and globs, in a stable order, each file once.

    A path that exists is taken as it is, even if its name holds glob characters (``notes[1].py``). Walks and
    globs never descend into a symlinked directory (a link to ``.`` would repeat the tree forever), and a file
    reached twice (named twice, or through a link) is read once."""
    files: list[Path] = []
    for item in inputs:
        if item == BUILTIN:
            files += stdlib_files()
            continue
        matches = _glob(item) if glob.has_magic(item) and not os.path.lexists(item) else [item]
        if not matches:
            raise UserError(f"input {item!r} matches no file (check the --inputs pattern)")
        for m in matches:
            p = Path(m)
            if p.is_dir():
                if _written_by_fitgpt(p):
                    raise UserError(f"input {item!r}: {m} is a folder fitgpt wrote (prepared data or a run), not text to "
                                    "train on; name the text itself in --inputs")
                files += _walk(p)
            elif p.is_file():
                files.append(p)
            else:
                raise UserError(f"input {item!r}: {m} does not exist (check the --inputs path)")
    return _once(files)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


FITGPT_MARKERS = (".fitgpt-lock", ".fitgpt-run")
"""Files in every folder fitgpt writes (prepared data, runs): such a folder is output, never input."""


def _written_by_fitgpt(directory: Path) -> bool:
    return any((directory / name).exists() for name in FITGPT_MARKERS)


def _walk(root: Path) -> list[Path]:
    """The files below ``root``, sorted: hidden names, symlinked directories and folders fitgpt wrote left out (a
    corpus walked from ``.`` must not take in its own prepared data or a run's metrics)."""
    files = []
    for here, dirs, names in os.walk(root):  # never follows a symlinked directory
        pruned = [d for d in dirs if not d.startswith(".") and not _written_by_fitgpt(Path(here, d))]
        if len(pruned) < sum(not d.startswith(".") for d in dirs):
            log.info("not reading folders fitgpt wrote under %s: %s", here, sorted(set(dirs) - set(pruned)))
        dirs[:] = pruned
        files += [Path(here, n) for n in names if not n.startswith(".") and Path(here, n).is_file()]
    return sorted(files)


def _glob(pattern: str) -> list[str]:
    """``glob.glob(pattern, recursive=True)`` without following symlinked directories: pathlib's ``**`` does not.
    The fixed leading part of the pattern is the root; hidden names match only where the pattern names them."""
    parts = Path(pattern).parts
    fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), len(parts))
    root, rest = Path(*parts[:fixed]) if fixed else Path("."), str(Path(*parts[fixed:]))
    found = []
    for p in root.glob(rest):
        rel = p.relative_to(root)
        if not any(part.startswith(".") and not pat.startswith(".") for part, pat in zip(rel.parts, Path(rest).parts)):
            found.append(str(p) if fixed else os.path.normpath(str(p)))
    return sorted(found)


def _once(files: list[Path]) -> list[Path]:
    """Each file once, at its first place, whatever names lead to it."""
    seen, out = set(), []
    for f in files:
        key = os.path.realpath(f)
        if key not in seen:
            seen.add(key)
            out.append(f)
    if len(out) < len(files):
        log.info("%d input files were named more than once (or reached through links): each is read once", len(files) - len(out))
    return out


RECORD_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
RECORD_SKIPS = {"no_field": "without the text field", "not_text": "whose field is not text (a number, null, a list...)",
                "empty": "with empty text"}
"""Why a record gave no document."""


def list_inputs(inputs: list[str]) -> list[str | Path]:
    """What ``read_documents`` reads, in its order: Hugging Face datasets (``hf:NAME``, as given), then the files."""
    return [i for i in inputs if i.startswith("hf:")] + expand_inputs([i for i in inputs if not i.startswith("hf:")])


def read_documents(items: list[str | Path], stats: CorpusStats, text_field: str = "text",
                   start: tuple[int, int] = (0, 0)) -> Iterator[Document]:
    """One document per usable text file or record of ``items`` (from `list_inputs`), from ``start`` on (a
    `Document.after`); binary, non-UTF-8 and empty files are skipped and recorded in ``stats``."""
    first, done = start
    for index in range(first, len(items)):
        item, skip = items[index], done if index == first else 0
        if isinstance(item, str):
            yield from _hf_documents(item, index, skip)
        else:
            yield from _file_documents(item, index, skip, stats, text_field)


def _file_documents(path: Path, index: int, skip: int, stats: CorpusStats, text_field: str) -> Iterator[Document]:
    st = path.stat()
    stats.seen[str(path)] = [st.st_size, st.st_mtime_ns]
    name = path.name.lower()
    if not st.st_size:  # an empty record file too (a compressed one is not even gzip): no text, like an empty file
        stats.sha256[str(path)] = hashlib.sha256(b"").hexdigest()
        stats.skipped[str(path)] = "empty"
        return
    if name.endswith(RECORD_SUFFIXES):
        yield from _record_documents(path, index, _records(path, text_field, skip), text_field, skip, stats)
        stats.sha256[str(path)] = sha256_file(path)  # a second read, from the page cache; hashing releases the GIL
        return
    raw = path.read_bytes()
    stats.sha256[str(path)] = hashlib.sha256(raw).hexdigest()
    if b"\x00" in raw[:8192]:
        stats.skipped[str(path)] = "binary"
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        stats.skipped[str(path)] = "not_utf8"
        return
    if not text.strip():
        stats.skipped[str(path)] = "empty"
        return
    records = _json_records(text) if name.endswith(".json") else None
    if records is not None:  # a .json array of records; any other .json is a text document
        yield from _record_documents(path, index, ((r, 0) for r in records[skip:]), text_field, skip, stats)
    elif not skip:
        yield Document(str(path), text, (index + 1, 0), len(raw))


def _record_documents(path: Path, index: int, records: Iterator[tuple[dict, int]], text_field: str, skip: int,
                      stats: CorpusStats) -> Iterator[Document]:
    """Each record's text a document, named ``path#record``; records without text are counted by reason in
    ``stats.records``, and a file none of whose records has the field is an error.

    ``records`` starts at record ``skip``: a reading resumed after a document of this file, which therefore had one.
    """
    used, keys, size = skip > 0, None, 0
    skips = stats.records.setdefault(str(path), dict.fromkeys(RECORD_SKIPS, 0))
    for i, (record, n) in enumerate(records, skip):
        size += n
        has = isinstance(record, dict) and text_field in record
        text = record[text_field] if has else None
        if keys is None and isinstance(record, dict):
            keys = sorted(record)
        if not isinstance(text, str) or not text.strip():
            skips["no_field" if not has else "not_text" if not isinstance(text, str) else "empty"] += 1
            continue
        used = True
        yield Document(f"{path}#{i}", text, (index, i + 1), size, dict(skips))
        size = 0
    if not used:
        if skips["not_text"]:
            have = f"{skips['not_text']:,} records hold a number, null or a list there, no string"
        elif skips["empty"]:
            have = "every record's text there is empty"
        else:
            have = f"its records have: {', '.join(keys)}" if keys else "it has no records of key-value pairs"
        raise UserError(f"{path}: no record has a text field {text_field!r} ({have}); set --text-field "
                         "(--data.text-field when training)")


def _records(path: Path, text_field: str, skip: int) -> Iterator[tuple[dict, int]]:
    """The records of a JSON Lines or Parquet file from record ``skip`` on (skipped ones are not parsed), each with
    the bytes it was read from (0 for Parquet, whose size is its text's)."""
    if path.name.lower().endswith(".parquet"):
        yield from _parquet_records(path, text_field, skip)
        return
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            seen = 0
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                seen += 1
                if seen <= skip:
                    continue
                try:
                    yield json.loads(line), len(line)
                except ValueError as e:  # UnicodeDecodeError included
                    raise UserError(f"{path}:{n}: not a JSON record ({e}); fix or remove the line") from None
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: corrupt deflate data inside a valid gzip header
        raise UserError(f"{path}: cannot be read as {'gzip-compressed ' if opener is gzip.open else ''}JSON Lines "
                         f"({e})") from None


def _json_records(text: str) -> list[dict] | None:
    """The records of a .json file holding an array of objects, else None (any other .json, a package.json or a list
    of numbers, is a text document). A UTF-8 byte-order mark is allowed, as for JSON Lines; records without the text
    field are counted, and a file none of whose records has text is refused, as there."""
    try:
        data = json.loads(text.removeprefix("\ufeff"))
    except ValueError:
        return None
    return data if isinstance(data, list) and data and all(isinstance(r, dict) for r in data) else None


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow: pip install 'fitgpt[parquet]'") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's own error for a file that is not Parquet
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None


def _parquet_records(path: Path, text_field: str, skip: int) -> Iterator[tuple[dict, int]]:
    f = _parquet_file(path)
    columns = f.schema_arrow.names
    if text_field not in columns:
        raise UserError(f"{path}: no column {text_field!r} (it has: {', '.join(columns)}); set --text-field "
                         "(--data.text-field when training)")
    for batch in f.iter_batches(columns=[text_field], batch_size=1024):  # a bounded slice of a row group at a time
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        for text in batch.column(0).slice(skip).to_pylist():
            yield {text_field: text}, 0
        skip = 0


GZIP_MIN = 20
"""Bytes of the smallest gzip file: a 10-byte header, an empty deflate stream (2) and an 8-byte trailer."""


def text_bytes(item: str | Path, text_field: str = "text") -> int:
    """About how many bytes of text an input holds, for progress and the tokenizer sample, without reading it:
    a file's size; a gzip file's recorded uncompressed size; a Parquet file's uncompressed text column."""
    if isinstance(item, str):
        ds, column = _hf_dataset(item)
        return ds.data.column(column).nbytes
    name = item.name.lower()
    if name.endswith(".gz"):
        if item.stat().st_size < GZIP_MIN:  # not even a gzip header and trailer: reading it says what it is
            return 0
        with open(item, "rb") as f:  # the gzip trailer: the uncompressed size modulo 2**32
            f.seek(-4, os.SEEK_END)
            size = int.from_bytes(f.read(4), "little")
        while size < item.stat().st_size:  # over 4 GiB the trailer wrapped; text never compresses to more than it was
            size += 1 << 32
        return size
    if name.endswith(".parquet"):
        f = _parquet_file(item)
        if text_field not in f.schema_arrow.names:
            return 0
        col = f.schema_arrow.names.index(text_field)
        md = f.metadata
        return sum(md.row_group(g).column(col).total_uncompressed_size for g in range(md.num_row_groups))
    return item.stat().st_size


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


@functools.lru_cache(maxsize=None)  # sized, sampled and read: opened once
def _hf_dataset(item: str):
    """A Hugging Face dataset from the local cache only (fitgpt never downloads at run time), and its text column."""
    name, _, column = item[3:].partition("#")
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"  # read when datasets is imported
    try:
        import datasets
    except ImportError:
        raise UserError("hf: inputs need the [hf] extra: pip install 'fitgpt[hf]'") from None
    try:
        ds = datasets.load_dataset(name, split="train")
    except Exception as e:  # not in the cache (the library's error varies by version): say so, and what to do
        raise UserError(
            f"Hugging Face dataset {name!r} is not in the local cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}); "
            f"fitgpt reads hf: inputs offline: download it once where there is network (datasets.load_dataset({name!r})), "
            f"or pass its files (.jsonl, .parquet) to --inputs [{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}]"
        ) from None
    column = column or "text"
    if column not in ds.column_names:
        raise UserError(f"dataset {name!r} has no column {column!r}; use hf:{name}#COLUMN with one of {ds.column_names}")
    return ds, column


def _hf_documents(item: str, index: int, skip: int) -> Iterator[Document]:
    ds, column = _hf_dataset(item)
    rows = ds.select_columns([column])
    for start in range(skip, len(rows), 1024):
        for i, text in enumerate(rows[start : start + 1024][column], start):
            if isinstance(text, str) and text.strip():
                yield Document(f"{item.partition('#')[0]}[{i}]", text, (index, i + 1))
