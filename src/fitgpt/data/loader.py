"""Token data opened as memmaps, checked cheaply, and sampled as random windows with a resumable RNG."""

from __future__ import annotations

import json
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
        self.splits: dict[str, np.memmap] = {}
        for split in ("train", "val"):
            path = self.dir / f"{split}.bin"
            expected = int(self.meta[f"{split}_tokens"])
            if not path.is_file():
                raise ValueError(f"{path} is missing; re-run `fitgpt prepare --dir {self.dir}`")
            size = path.stat().st_size
            if size != expected * dtype.itemsize:
                raise ValueError(
                    f"{path} holds {size} bytes but {meta_path} says {expected} {dtype.name} tokens "
                    f"({expected * dtype.itemsize} bytes); the data is truncated or from another preparation: re-run `fitgpt prepare`"
                )
            if expected == 0:
                raise ValueError(f"{path} is empty; give `fitgpt prepare` more text")
            self.splits[split] = np.memmap(path, dtype=dtype, mode="r")
        self._check_ids()
        self._check_tokenizer()

    def _check_tokenizer(self) -> None:
        """The tokenizer.json beside the data must be the one that produced it (meta.json records its hash)."""
        tok = self.dir / "tokenizer.json"
        expected = self.meta.get("tokenizer_sha256")
        if not tok.is_file():
            raise ValueError(f"{tok} is missing; re-run `fitgpt prepare --dir {self.dir}`")
        self.tokenizer_sha256 = sha256_file(tok)
        if expected and self.tokenizer_sha256 != expected:
            raise ValueError(
                f"{tok} is not the tokenizer that produced {self.dir / 'train.bin'} (its sha256 differs from "
                f"{self.dir / META_FILE}); the data and its tokenizer do not match: re-run `fitgpt prepare --dir {self.dir}`"
            )

    def _check_ids(self, samples: int = 64, window: int = 4096) -> None:
        """Token ids must be below vocab_size: a scan of sampled windows, cheap on any size."""
        rng = np.random.default_rng(0)
        for split, arr in self.splits.items():
            starts = rng.integers(0, max(1, len(arr) - window), size=samples)
            top = max(int(arr[s : s + window].max()) for s in starts)
            top = max(top, int(arr[-window:].max()))
            if top >= self.vocab_size:
                raise ValueError(
                    f"{self.dir / (split + '.bin')} holds token id {top}, but meta.json says vocab_size {self.vocab_size}; "
                    "the data and its tokenizer do not match: re-run `fitgpt prepare`"
                )

    def check_context(self, context_length: int) -> None:
        for split, arr in self.splits.items():
            if len(arr) < context_length + 1:
                raise ValueError(
                    f"{self.dir / (split + '.bin')} has {len(arr)} tokens, fewer than one context window + 1 "
                    f"({context_length + 1}); lower --model.context-length or prepare more text"
                )


class BatchSampler:
    """Random (x, y) windows from one split; the RNG state is saved with checkpoints for exact resume."""

    def __init__(self, tokens: np.ndarray, batch_size: int, context_length: int, seed: int) -> None:
        self.tokens = tokens
        self.batch_size = batch_size
        self.context_length = context_length
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def next_batch(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        T = self.context_length
        ix = self.rng.integers(0, len(self.tokens) - T, size=self.batch_size)
        x = torch.from_numpy(np.stack([self.tokens[i : i + T].astype(np.int64) for i in ix]))  # (B, T)
        y = torch.from_numpy(np.stack([self.tokens[i + 1 : i + 1 + T].astype(np.int64) for i in ix]))  # (B, T)
        if torch.device(device).type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x.to(device), y.to(device)

    def state_dict(self) -> dict:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state
