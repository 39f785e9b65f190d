"""The data settings: what to read, how to tokenize it, and where the prepared shards live.

Imports nothing heavy (no tokenizer, no pipeline): the training config and the planner load it.
Checks here are about the values alone; whether a file exists is asked where it is used, so that an
old config.json whose tokenizer file moved still loads."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

from fitgpt.errors import UserError, require_finite, require_not_empty
from fitgpt.units import parse_bytes
from fitgpt.utils import sha256_file

BUILTIN = "stdlib"
"""The built-in corpus: the running Python's standard library (`fitgpt.data.corpus`)."""
MAX_VOCAB = 1 << 20
"""The largest BPE vocabulary fitgpt trains (today's largest models use about 256k); the BPE trainer allocates
for the size asked, so a typo of 999999999 would ask for tens of GB."""


def tokenizer_file(name: str) -> Path:
    """--tokenizer naming a tokenizer.json to reuse: the file, which must exist."""
    path = Path(name)
    if not path.is_file():
        raise UserError(f"--tokenizer {name!r}: not bpe, gpt2 or an existing tokenizer.json file")
    return path


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
    """Share of the documents held out for validation, each drawn by a seeded hash of its text, not its path (a
    corpus of too few documents to draw any holds out this share of its last tokens instead)."""
    seed: int = 1337
    """Seed of the train/val draw and of the tokenizer sample."""
    shard_tokens: int = 100_000_000
    """Tokens per output shard: a shard closes at the first document end past this, and a resumed preparation
    starts again from the last closed one."""

    FLAGS: ClassVar[str] = "--data."
    """How the command that takes these settings spells their flags (fitgpt train's; fitgpt prepare's are bare)."""

    def __post_init__(self) -> None:
        flag = self.flag
        require_finite(self, "data.", self.FLAGS)
        require_not_empty(self, ("dir", "text_field", "tokenizer", "tokenizer_sample"), self.FLAGS[2:])
        if not 0.0 < self.val_fraction < 0.5:
            raise UserError(f"{flag('val_fraction')} must be in (0, 0.5), got {self.val_fraction}")
        if self.tokenizer == "bpe" and not 258 <= self.vocab_size <= MAX_VOCAB:
            raise UserError(f"{flag('vocab_size')} must be in [258, {MAX_VOCAB:,}] for bpe, got {self.vocab_size:,}")
        if parse_bytes(self.tokenizer_sample, flag=flag("tokenizer_sample")) <= 0:
            raise UserError(f"{flag('tokenizer_sample')} must be positive, e.g. 200MB")
        if self.shard_tokens < 1:
            raise UserError(f"{flag('shard_tokens')} must be positive, got {self.shard_tokens}")
        if not self.inputs:
            raise UserError(f"{flag('inputs')} is empty; name at least one file, directory or 'stdlib'")

    def flag(self, name: str) -> str:
        """The flag that sets field ``name``, as this command spells it."""
        return self.FLAGS + name.replace("_", "-")

    @property
    def path(self) -> Path:
        """The data directory: as given, or one named after the inputs and tokenizer, so that
        different preparations never overwrite each other."""
        if self.dir:
            return Path(self.dir)
        name = BUILTIN if list(self.inputs) == [BUILTIN] else "custom-" + hashlib.sha256("\0".join(self.inputs).encode()).hexdigest()[:8]
        if self.tokenizer not in ("bpe", "gpt2"):  # a tokenizer file: named after its contents
            return Path("data") / f"{name}-tok{sha256_file(tokenizer_file(self.tokenizer))[:8]}"
        return Path("data") / (f"{name}-gpt2" if self.tokenizer == "gpt2" else f"{name}-bpe{self.vocab_size}")
