"""Token shards: each split's tokens in numbered files, written so that an interrupted preparation resumes.

A split's tokens go to ``{split}_{k:06d}.bin`` files. A shard closes at the first document end past
``shard_tokens``, so shards hold whole documents. Closing a shard is a checkpoint: the open shards of
both splits are flushed to disk, what closed since the last checkpoint (shards, input files read to
the end) is appended to ``journal.jsonl``, and ``progress.json`` (small, written atomically) records
how much of the journal and of each open shard is committed, and where reading resumes. A checkpoint
costs what happened since the last one, however many shards came before. A resumed preparation cuts
the journal and each open shard back to what was committed and goes on from there, so that its output
is byte for byte an uninterrupted one's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

SPLITS = ("train", "val")
PROGRESS_FILE = "progress.json"
JOURNAL_FILE = "journal.jsonl"


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


class ShardWriter:
    """Appends one split's tokens to its shards in ``directory``."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int,
                 shards: list[dict] | None = None, open_tokens: int = 0) -> None:
        self.dir, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards = list(shards or [])  # closed: [{"file": name, "tokens": n}]
        self.open_tokens = open_tokens  # committed tokens of the open shard (a resumed one's are on disk)
        self._f = None
        for s in self.shards:
            _check_size(directory / s["file"], s["tokens"] * dtype.itemsize, exact=True)
        if open_tokens:
            _check_size(self._open_path(), open_tokens * dtype.itemsize, exact=False)

    @property
    def tokens(self) -> int:
        return sum(s["tokens"] for s in self.shards) + self.open_tokens

    def _open_path(self) -> Path:
        return self.dir / shard_name(self.split, len(self.shards))

    def _file(self):
        if self._f is None:
            self._f = open(self._open_path(), "r+b" if self.open_tokens else "wb")
            self._f.truncate(self.open_tokens * self.dtype.itemsize)  # what a killed run wrote after its last checkpoint
            self._f.seek(0, os.SEEK_END)
        return self._f

    def write(self, tokens: np.ndarray, doc_end: bool) -> bool:
        """Append ``tokens`` (a document's, or a piece of one); True if this closed a shard."""
        self._file().write(tokens.tobytes())
        self.open_tokens += len(tokens)
        if doc_end and self.open_tokens >= self.shard_tokens:
            self.close_shard()
            return True
        return False

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())

    def close_shard(self) -> None:
        if not self.open_tokens:
            return
        f = self._file()  # a resumed shard no token has reached since: opened, so cut back to what was committed
        self.flush()
        f.close()
        self._f = None
        self.shards.append({"file": self._open_path().name, "tokens": self.open_tokens})
        self.open_tokens = 0

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None

    def state(self) -> dict:
        return {"shards": list(self.shards), "open_tokens": self.open_tokens}


def _check_size(path: Path, size: int, exact: bool) -> None:
    have = path.stat().st_size if path.is_file() else -1
    if have < size or (exact and have != size):
        raise StaleProgress(f"{path.name} holds {max(have, 0)} bytes, not the {size} its progress records")


class StaleProgress(Exception):
    """An interrupted preparation that cannot be continued as it stands (the caller starts over)."""


def save_progress(directory: Path, writers: dict[str, ShardWriter], state: dict, finished: list[dict] = ()) -> None:
    """A checkpoint: the open shards' bytes on disk first; then the shards closed since the last checkpoint and the
    ``finished`` input files' records appended to the journal; then ``state`` without what the journal holds
    (``splits``' closed shards, ``corpus``'s finished files) as ``progress.json``, atomically."""
    for w in writers.values():
        w.flush()
    state["splits"] = {split: w.state() for split, w in writers.items()}
    logged = state.setdefault("journaled", {"shards": {}, "bytes": 0})
    entries = [{"shard": split, **s} for split, w in writers.items() for s in w.shards[logged["shards"].get(split, 0):]]
    entries += [{"input": f} for f in finished]
    journal = directory / JOURNAL_FILE
    with open(journal, "r+b" if journal.exists() else "wb") as f:
        f.truncate(logged["bytes"])  # what a killed run appended after its last checkpoint
        f.seek(logged["bytes"])
        f.write("".join(json.dumps(e) + "\n" for e in entries).encode())
        f.flush()
        os.fsync(f.fileno())
        logged["bytes"] = f.tell()
    logged["shards"] = {split: len(w.shards) for split, w in writers.items()}
    small = {**state, "splits": {split: {"open_tokens": w.open_tokens} for split, w in writers.items()},
             "corpus": state.get("current_file")}
    small.pop("current_file", None)
    tmp = directory / f"{PROGRESS_FILE}.tmp"
    with open(tmp, "w") as f:
        json.dump(small, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / PROGRESS_FILE)


def load_progress(directory: Path) -> tuple[dict, list[dict]] | None:
    """The state ``save_progress`` committed last, its ``splits`` whole again from the journal, and the finished
    files' records; None if there is none (no progress.json). Raises StaleProgress, naming the file, if one is
    there but cannot be read back."""
    if not (directory / PROGRESS_FILE).is_file():
        return None
    reading = directory / PROGRESS_FILE
    try:
        state = json.loads(reading.read_text())
        logged = state["journaled"]
        reading = directory / JOURNAL_FILE
        with open(reading, "rb") as f:
            lines = f.read(logged["bytes"]).decode().splitlines()
        entries = [json.loads(line) for line in lines]
        shards: dict[str, list[dict]] = {split: [] for split in SPLITS}
        for e in entries:
            if "shard" in e:
                shards[e.pop("shard")].append(e)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise StaleProgress(f"{reading} is unreadable ({type(e).__name__}: {e})") from None
    if any(len(shards[s]) != logged["shards"].get(s, 0) for s in SPLITS):
        raise StaleProgress(f"{directory / JOURNAL_FILE} lists other shards than {PROGRESS_FILE} records")
    state["splits"] = {s: {"shards": shards[s], **state["splits"].get(s, {})} for s in SPLITS}
    return state, [e["input"] for e in entries if "input" in e]
