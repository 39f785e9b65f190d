"""Token shards opened as memmaps, checked cheaply, and sampled as random windows with a resumable RNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fitgpt.data.prepared import FORMAT_VERSION, META_FILE
from fitgpt.errors import UserError
from fitgpt.utils import sha256_file

FULL_SCAN_TOKENS = 1 << 28
"""A split of at most this many tokens (512 MB of uint16) has every id checked at start."""


def out_of_vocabulary(filename: str, token: int, vocab_size: int) -> str:
    return (f"{filename} holds token id {token}, but meta.json says vocab_size {vocab_size}; the data and its tokenizer "
            "do not match: re-run `fitgpt prepare`")


class TokenData:
    """The prepared splits of one data directory, validated against meta.json."""

    def __init__(self, directory: str | Path, meta: dict | None = None) -> None:
        """``meta``: the directory's meta.json as already read and checked (`ensure_prepared`), or None to read it."""
        self.dir = Path(directory)
        meta_path = self.dir / META_FILE
        if meta is None and not meta_path.is_file():
            raise UserError(f"{meta_path} is missing: run `fitgpt prepare --dir {self.dir}` first")
        try:
            self.meta = meta if meta is not None else json.loads(meta_path.read_text())
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta["dtype"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"{meta_path} is unreadable or incomplete ({e}); re-run `fitgpt prepare`") from None
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise UserError(f"{self.dir} holds data in format {self.meta.get('format_version')} (from a pre-release "
                            f"fitgpt); this one reads format {FORMAT_VERSION}: re-run `fitgpt prepare --dir {self.dir}`")
        self.splits: dict[str, list[np.memmap]] = {}
        for split in ("train", "val"):
            shards = self._shards(split)
            if not any(tokens for _, tokens in shards):
                raise UserError(f"{self.dir} holds no {split} tokens; give `fitgpt prepare` more text")
            self.splits[split] = [self._open(path, tokens, dtype) for path, tokens in shards if tokens]
        self._check_ids()
        self._check_tokenizer()

    def _shards(self, split: str) -> list[tuple[Path, int]]:
        """The split's shard files and token counts."""
        try:
            return [(self.dir / s["file"], int(s["tokens"])) for s in self.meta["shards"][split]]
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{self.dir / META_FILE} is unreadable or incomplete ({e}); re-run `fitgpt prepare`") from None

    def _open(self, path: Path, tokens: int, dtype: np.dtype) -> np.memmap:
        if not path.is_file():
            raise UserError(f"{path} is missing; re-run `fitgpt prepare --dir {self.dir}`")
        size = path.stat().st_size
        if size != tokens * dtype.itemsize:
            raise UserError(
                f"{path} holds {size} bytes but {self.dir / META_FILE} says {tokens} {dtype.name} tokens "
                f"({tokens * dtype.itemsize} bytes); the data is truncated or from another preparation: re-run `fitgpt prepare`"
            )
        return np.memmap(path, dtype=dtype, mode="r")

    def _check_tokenizer(self) -> None:
        """The tokenizer.json beside the data must be the one that produced it (meta.json records its hash)."""
        tok = self.dir / "tokenizer.json"
        expected = self.meta.get("tokenizer_sha256")
        if not tok.is_file():
            raise UserError(f"{tok} is missing; re-run `fitgpt prepare --dir {self.dir}`")
        self.tokenizer_sha256 = sha256_file(tok)
        if expected and self.tokenizer_sha256 != expected:
            raise UserError(
                f"{tok} is not the tokenizer that produced the token shards in {self.dir} (its sha256 differs from "
                f"{self.dir / META_FILE}); the data and its tokenizer do not match: re-run `fitgpt prepare --dir {self.dir}`"
            )

    def _check_ids(self, samples: int = 64, window: int = 4096, whole: int = FULL_SCAN_TOKENS) -> None:
        """Token ids must be below vocab_size: every id of a split up to ``whole`` tokens (a fraction of a second), of
        a larger one sampled windows and each shard's end; the sampler checks every batch it draws besides. Every rank
        runs this on the same files, so a bad id stops them all here, alike."""
        rng = np.random.default_rng(0)
        for shards in self.splits.values():
            scan_all = sum(len(a) for a in shards) <= whole
            for arr in shards:
                if scan_all:
                    top = int(arr.max())
                else:
                    starts = rng.integers(0, max(1, len(arr) - window), size=max(1, samples // len(shards)))
                    top = max(max(int(arr[s : s + window].max()) for s in starts), int(arr[-window:].max()))
                if top >= self.vocab_size:
                    raise UserError(out_of_vocabulary(arr.filename, top, self.vocab_size))

    def check_context(self, context_length: int) -> None:
        for split, shards in self.splits.items():
            total = sum(len(a) for a in shards)
            if total < context_length + 1:
                raise UserError(
                    f"the {split} split of {self.dir} holds {total} tokens, fewer than one context window + 1 "
                    f"({context_length + 1}); lower --model.context-length or prepare more text"
                )


class BatchSampler:
    """Random (x, y) windows from one split's shards, drawn a global batch at a time (Megatron's rule), with the RNG
    state saved with checkpoints for exact resume.

    Each step's global batch (``batch_size`` x ``grad_accum`` x ``ranks`` windows) is drawn whole, in one call, by
    every data-parallel rank from the same RNG; rank r takes its contiguous slice of ``batch_size`` x ``grad_accum``,
    a micro-batch at a time. So a global batch is the same windows in the same order whatever the data-parallel
    degree and accumulation that cut it: one process of 8 micro-batches, DDP 2 of 4, FSDP 4 of 2 train on the same
    samples, and a run resumed on another layout of the same global batch continues the same stream. One process of
    one micro-batch a step draws exactly what the per-rank sampler before it drew.

    The shards are read as one stream of tokens, in order: a shard closes at a document's end, so a window
    running from one shard into the next crosses a document boundary, as windows inside a shard do, and every
    token can be drawn however short the shards are. Every window start is equally likely; with one shard
    the draws are exactly those of a single token array.
    """

    def __init__(self, tokens: np.ndarray | Sequence[np.ndarray], batch_size: int, context_length: int, seed: int,
                 vocab_size: int | None = None, ranks: int = 1, rank: int = 0, grad_accum: int = 1) -> None:
        """``vocab_size``: every batch's ids are checked below it (an id the start's check did not read would index
        past the embedding), naming the shard that holds one. ``ranks``, ``rank``: the data-parallel degree and this
        process's place in it; ``grad_accum``: micro-batches a step (with ``ranks``, they cut the global batch)."""
        self.shards = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        self.vocab_size = vocab_size
        self.batch_size = batch_size
        self.context_length = context_length
        self.ranks, self.rank, self.grad_accum = ranks, rank, grad_accum
        self.rng = np.random.Generator(np.random.PCG64(seed))
        self._offsets = np.cumsum([0, *(len(s) for s in self.shards)])  # where each shard starts in the stream
        self._starts = max(1, int(self._offsets[-1]) - context_length)  # window starts the stream offers
        self._global = np.zeros(0, dtype=np.int64)  # (G,) the current global batch's window starts
        self._taken = grad_accum  # this rank's micro-batches of it taken so far (all: the next draws anew)

    @property
    def global_batch(self) -> int:
        """Windows a step draws, over every data-parallel rank and micro-batch."""
        return self.batch_size * self.grad_accum * self.ranks

    def _window(self, start: int, n: int) -> np.ndarray:
        """``n`` tokens of the stream from ``start``, across as many shards as they span."""
        k = int(np.searchsorted(self._offsets, start, side="right")) - 1
        pieces = []
        while n > 0:
            piece = self.shards[k][start - self._offsets[k] : start - self._offsets[k] + n]
            pieces.append(piece)
            n, start, k = n - len(piece), start + len(piece), k + 1
        return (pieces[0] if len(pieces) == 1 else np.concatenate(pieces)).astype(np.int64)

    def _next_starts(self) -> np.ndarray:
        """This rank's next micro-batch's window starts, (B,): its slice of the global batch, drawn when it is spent."""
        if self._taken >= self.grad_accum:
            self._global = self.rng.integers(0, self._starts, size=self.global_batch)  # (G,) alike on every rank
            self._taken = 0
        lo = (self.rank * self.grad_accum + self._taken) * self.batch_size
        self._taken += 1
        return self._global[lo : lo + self.batch_size]

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        T = self.context_length
        ix = self._next_starts()  # (B,) window starts in the stream
        xy = torch.from_numpy(np.stack([self._window(int(i), T + 1) for i in ix]))  # (B, T + 1)
        if self.vocab_size is not None and int(xy.max()) >= self.vocab_size:
            row, col = divmod(int(xy.argmax()), T + 1)
            k = int(np.searchsorted(self._offsets, int(ix[row]) + col, side="right")) - 1
            raise UserError(out_of_vocabulary(getattr(self.shards[k], "filename", "a shard"), int(xy.max()), self.vocab_size))
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each, as a model's .view() expects
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def state_dict(self) -> dict:
        """Where the stream stands: the RNG, the global batch, and (between a step's micro-batches) what of the
        current one is drawn and taken. The same on every data-parallel rank."""
        within = None
        if self._taken < self.grad_accum:  # a step's micro-batches part taken (a step's checkpoint comes after them)
            within = {"starts": self._global.tolist(), "taken": self._taken, "cut": [self.ranks, self.grad_accum]}
        return {"kind": GLOBAL_BATCH, "global_batch": self.global_batch, "rng": self.rng.bit_generator.state,
                "within": within}

    def load_state_dict(self, state: dict) -> None:
        """A state of ``state_dict``, or of the per-rank sampler before it (its RNG alone: the global batch drawn
        from there on)."""
        if state.get("kind") != GLOBAL_BATCH:  # the per-rank sampler's: a bare RNG state
            self.rng.bit_generator.state = state
            self._taken = self.grad_accum
            return
        self.rng.bit_generator.state = state["rng"]
        within = state.get("within")
        if within and within.get("cut") == [self.ranks, self.grad_accum] and state.get("global_batch") == self.global_batch:
            self._global, self._taken = np.asarray(within["starts"], dtype=np.int64), int(within["taken"])
        else:  # at a step's end, or a part-taken global batch cut otherwise now: the next is drawn
            self._taken = self.grad_accum


GLOBAL_BATCH = "global-batch"
"""The state_dict kind of the sampler that draws a global batch at a time (a checkpoint without it: the per-rank
sampler's)."""
