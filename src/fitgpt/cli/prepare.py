"""`fitgpt prepare`: text in, train.bin / val.bin / tokenizer.json / meta.json out."""

from __future__ import annotations

import tyro

from fitgpt.data import DataConfig, prepare


def run(args: list[str]) -> int:
    cfg = tyro.cli(DataConfig, args=args, prog="fitgpt prepare", description="Tokenize text into train/val memmaps.")
    meta = prepare(cfg)
    print(f"{cfg.path}: {meta['train_tokens']} train / {meta['val_tokens']} val tokens, vocab {meta['vocab_size']} "
          f"({meta['tokenizer']}), {meta['documents']} documents, skipped {meta['skipped']}")
    return 0
