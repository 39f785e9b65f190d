"""One family of shapes, set by one knob, depth, as nanochat sets its models: width ``aspect`` a block (n_embed =
aspect x depth; nanochat's 64, or 32 where a small budget needs smaller models), heads of 64 (of the width, where it
is narrower), the MLP and everything else as the base model has them (GPT-2's 4x, Llama's SwiGLU at 8/3, its
key/value heads one per query head). Non-embedding parameters grow as depth^3 (12 x aspect^2 x depth^3 for GPT-2's
blocks): eight times from one depth to its double.

With ``mup``, every depth is the muP + CompleteP reparametrisation of depth 1 (`ModelConfig.mup_base_width`,
`mup_base_depth`): a learning rate good at depth 1 is good at every depth (Yang et al. 2022; Dey et al. 2025)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer

HEAD_DIM = 64


@dataclass(frozen=True)
class Family:
    aspect: int = 64
    """Width a block: n_embed = aspect x depth."""
    mup: bool = False
    """Every depth muP + CompleteP over depth 1 (its learning rate transfers)."""

    def __post_init__(self) -> None:
        if self.aspect not in (16, 32, 64, 128):
            raise UserError(f"--aspect {self.aspect}: the family's width a block is 16, 32, 64 or 128")

    def width(self, depth: int) -> int:
        return self.aspect * depth

    def shape(self, depth: int, base: ModelConfig) -> ModelConfig:
        """The family's model of ``depth`` blocks on ``base``'s architecture, vocabulary and context."""
        width = self.width(depth)
        mup = {"mup_base_width": self.aspect, "mup_base_depth": 1} if self.mup else {"mup_base_width": 0, "mup_base_depth": 0}
        return dataclasses.replace(base, n_blocks=depth, n_embed=width, n_head=width // min(HEAD_DIM, self.aspect),
                                   n_kv_head=None, ffn_hidden=None, **mup)

    def describe(self) -> str:
        return (f"n_embed = {self.aspect} x depth, heads of {min(HEAD_DIM, self.aspect)}"
                + (", muP + CompleteP over depth 1" if self.mup else ""))

    @classmethod
    def of_recipe(cls, recipe: dict) -> Family:
        """The family a law's points were trained in (a law of before the family had settings: the default)."""
        return cls(int(recipe.get("aspect", 64)), bool(recipe.get("mup", False)))


NANOCHAT = Family()
"""nanochat's family: 64 a block, the standard parametrisation (fit's rows without a law of the user's)."""


def non_embedding_params(cfg: ModelConfig) -> int:
    """The parameters a scaling law counts: all but the token and position tables and the head's matrix."""
    with torch.device("meta"):
        model = Transformer(cfg)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} | {id(model.lm_head.weight)}
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in tables)


def compute_params(cfg: ModelConfig, n_params: int | None = None) -> int:
    """The parameters each token's compute passes through: the non-embedding ones and the head's matrix (a table's
    lookup costs nothing). A run's FLOPs are about 6 x these x its tokens: the compute of an iso-FLOP level, counted
    as Porian et al. (2024) count it (at these sizes the head is most of it). ``n_params``: its non-embedding count,
    where the caller has it (else counted here, on the meta device)."""
    return (non_embedding_params(cfg) if n_params is None else n_params) + cfg.vocab_size * cfg.n_embed


def warmup_for(warmup_steps: int, steps: int) -> int:
    """A recipe's warmup in a run of ``steps``: at most a tenth of it (a short run would otherwise be mostly warmup,
    and leave no stable learning rate to branch from). The ladder's runs and the runs fit picks share it."""
    return max(1, min(warmup_steps, steps // 10))
