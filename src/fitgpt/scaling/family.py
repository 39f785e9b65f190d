"""One family of shapes, set by one knob, depth, as nanochat sets its models: width 64 a block (n_embed = 64 x depth),
heads of 64 (as many heads as blocks), the MLP and everything else as the base model has them (GPT-2's 4x, Llama's
SwiGLU at 8/3, its key/value heads one per query head). Non-embedding parameters grow as depth^3 (12 x 4096 x depth^3
for GPT-2's blocks): eight times from one depth to its double."""

from __future__ import annotations

import dataclasses

import torch

from fitgpt.model import ModelConfig, Transformer

WIDTH_PER_BLOCK = 64
HEAD_DIM = 64


def shape(depth: int, base: ModelConfig) -> ModelConfig:
    """The family's model of ``depth`` blocks on ``base``'s architecture, vocabulary and context."""
    width = WIDTH_PER_BLOCK * depth
    return dataclasses.replace(base, n_blocks=depth, n_embed=width, n_head=width // HEAD_DIM, n_kv_head=None,
                               ffn_hidden=None)


def non_embedding_params(cfg: ModelConfig) -> int:
    """The parameters a scaling law counts: all but the token and position tables and the head's matrix."""
    with torch.device("meta"):
        model = Transformer(cfg)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | {id(model.lm_head.weight)}
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in tables)


def flags(depth: int) -> list[str]:
    """The train flags that set the family's shape of ``depth``."""
    width = WIDTH_PER_BLOCK * depth
    return ["--model.n-blocks", str(depth), "--model.n-embed", str(width), "--model.n-head", str(width // HEAD_DIM)]


def warmup_for(warmup_steps: int, steps: int) -> int:
    """A recipe's warmup in a run of ``steps``: at most a tenth of it (a short run would otherwise be mostly warmup,
    and leave no stable learning rate to branch from). The ladder's runs and the runs fit picks share it."""
    return max(1, min(warmup_steps, steps // 10))
