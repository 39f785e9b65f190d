"""Data: gather text, tokenize it into memmaps, sample training windows."""

from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.data.prepare import DataConfig, ensure_prepared, prepare
from fitgpt.data.tokenizer import Tokenizer

__all__ = ["BatchSampler", "DataConfig", "TokenData", "Tokenizer", "ensure_prepared", "prepare"]
