"""Token shards opened as memmaps, checked cheaply, and sampled as random windows with a resumable RNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from fitgpt.data.prepare import META_FILE
from fitgpt.utils import sha256_file


class TokenData:
    """The prepared splits of one data directory, validated against meta.json."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise ValueError(f"{meta_path} is missing: run `fitgpt prepare --dir {self.dir}` first")
        try:
            self.meta = json.loads(meta_path.read_text())
            self.vocab_size = int(self.meta["vocab_size"])
            dtype = np.dtype(self.meta["dtype"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{meta_path} is unreadable or incomplete ({e}); re-run `fitgpt prepare`") from None
        self.splits: dict[str, list[np.memmap]] = {}
        for split in ("train", "val"):
            shards = self._shards(split)
            if not any(tokens for _, tokens in shards):
                raise ValueError(f"{self.dir} holds no {split} tokens; give `fitgpt prepare` more text")
            self.splits[split] = [self._open(path, tokens, dtype) for path, tokens in shards if tokens]
        self._check_ids()
        self._check_tokenizer()

    def _shards(self, split: str) -> list[tuple[Path, int]]:
        """The split's shard files and token counts; data prepared before shards has one file a split."""
        listed = self.meta.get("shards", {split: [{"file": f"{split}.bin", "tokens": self.meta.get(f"{split}_tokens")}]})
        try:
            return [(self.dir / s["file"], int(s["tokens"])) for s in listed[split]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{self.dir / META_FILE} is unreadable or incomplete ({e}); re-run `fitgpt prepare`") from None

    def _open(self, path: Path, tokens: int, dtype: np.dtype) -> np.memmap:
        if not path.is_file():
            raise ValueError(f"{path} is missing; re-run `fitgpt prepare --dir {self.dir}`")
        size = path.stat().st_size
        if size != tokens * dtype.itemsize:
            raise ValueError(
                f"{path} holds {size} bytes but {self.dir / META_FILE} says {tokens} {dtype.name} tokens "
                f"({tokens * dtype.itemsize} bytes); the data is truncated or from another preparation: re-run `fitgpt prepare`"
            )
        return np.memmap(path, dtype=dtype, mode="r")

    def _check_tokenizer(self) -> None:
        """The tokenizer.json beside the data must be the one that produced it (meta.json records its hash)."""
        tok = self.dir / "tokenizer.json"
        expected = self.meta.get("tokenizer_sha256")
        if not tok.is_file():
            raise ValueError(f"{tok} is missing; re-run `fitgpt prepare --dir {self.dir}`")
        self.tokenizer_sha256 = sha256_file(tok)
        if expected and self.tokenizer_sha256 != expected:
            raise ValueError(
                f"{tok} is not the tokenizer that produced the token shards in {self.dir} (its sha256 differs from "
                f"{self.dir / META_FILE}); the data and its tokenizer do not match: re-run `fitgpt prepare --dir {self.dir}`"
            )

    def _check_ids(self, samples: int = 64, window: int = 4096) -> None:
        """Token ids must be below vocab_size: a scan of sampled windows and of each shard's end, cheap on any size."""
        rng = np.random.default_rng(0)
        for shards in self.splits.values():
            for arr in shards:
                starts = rng.integers(0, max(1, len(arr) - window), size=max(1, samples // len(shards)))
                top = max(max(int(arr[s : s + window].max()) for s in starts), int(arr[-window:].max()))
                if top >= self.vocab_size:
                    raise ValueError(
                        f"{arr.filename} holds token id {top}, but meta.json says vocab_size {self.vocab_size}; "
                        "the data and its tokenizer do not match: re-run `fitgpt prepare`"
                    )

    def check_context(self, context_length: int) -> None:
        for split, shards in self.splits.items():
            longest = max(len(a) for a in shards)
            if longest < context_length + 1:
                raise ValueError(
                    f"the {split} shards of {self.dir} hold at most {longest} tokens each, fewer than one context window + 1 "
                    f"({context_length + 1}); lower --model.context-length or prepare more text"
                )


class BatchSampler:
    """Random (x, y) windows from one split's shards; the RNG state is saved with checkpoints for exact resume.

    Every window start of every shard is equally likely, and a window never crosses a shard's end. With one
    shard the draws are exactly those of a single token array.
    """

    def __init__(self, tokens: np.ndarray | Sequence[np.ndarray], batch_size: int, context_length: int, seed: int) -> None:
        self.shards = [tokens] if isinstance(tokens, np.ndarray) else list(tokens)
        self.batch_size = batch_size
        self.context_length = context_length
        self.rng = np.random.Generator(np.random.PCG64(seed))
        starts = np.asarray([max(0, len(s) - context_length) for s in self.shards])  # window starts each shard offers
        self._ends = np.cumsum(starts)
        self._firsts = self._ends - starts

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        T = self.context_length
        ix = self.rng.integers(0, self._ends[-1], size=self.batch_size)  # (B,) over all shards' starts
        shard = np.searchsorted(self._ends, ix, side="right")
        windows = [self.shards[k][i - self._firsts[k] : i - self._firsts[k] + T + 1].astype(np.int64) for k, i in zip(shard, ix)]
        xy = torch.from_numpy(np.stack(windows))  # (B, T + 1)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()  # (B, T) each, as a model's .view() expects
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def state_dict(self) -> dict:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state
