"""`fitgpt prepare`: text in, token shards / tokenizer.json / meta.json out."""

from __future__ import annotations

from dataclasses import dataclass

import tyro

from fitgpt.data.config import DataConfig
from fitgpt.data.prepare import prepare


@dataclass
class PrepareConfig(DataConfig):
    FLAGS = "--"  # prepare's flags are the settings' bare names: its errors name those
    resume: bool = False
    """Continue a preparation of the same inputs and settings that was interrupted (Ctrl-C, a kill, a full disk)
    from its last closed shard; without it an interrupted one is started over."""


def run(args: list[str]) -> int:
    cfg = tyro.cli(PrepareConfig, args=args, prog="fitgpt prepare", description="Tokenize text into train/val token shards.")
    meta = prepare(cfg, resume=cfg.resume)
    shards = sum(len(s) for s in meta["shards"].values())
    print(f"{cfg.path}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens in {shards} shards, vocab "
          f"{meta['vocab_size']} ({meta['tokenizer']}), {meta['documents']:,} documents ({meta['val_documents']:,} for "
          f"validation), skipped {meta['skipped']}")
    return 0
