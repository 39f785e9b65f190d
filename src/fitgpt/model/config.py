"""The model's shape, as one typed dataclass that validates itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from fitgpt.errors import UserError, require_finite


def require_positive_ints(obj: object, names: tuple[str, ...], section: str = "") -> None:
    """Raise a UserError naming the field and its flag when one of ``names`` is not a positive int."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            flag = f"--{section}{name.replace('_', '-')}"
            raise UserError(f"{section}{name} must be a positive integer, got {value!r} (set {flag})")


@dataclass
class ModelConfig:
    """Shape of the model: a GPT-2 block (the seed's) or a Llama-family one."""

    arch: Literal["gpt2", "llama"] = "gpt2"
    """gpt2: LayerNorm, learned positions, GELU MLP, biases. llama: RMSNorm, rotary positions, SwiGLU MLP,
    grouped-query attention, no biases."""
    vocab_size: int = 2048
    """Number of token ids the embedding and head cover (taken from the prepared data when training)."""
    context_length: int = 128
    """Longest sequence the model attends over (size of the position embedding)."""
    n_embed: int = 128
    """Width of the residual stream."""
    n_head: int = 4
    """Attention heads per block; must divide n_embed."""
    n_blocks: int = 4
    """Number of transformer blocks."""
    dropout: float = 0.0
    """Dropout probability on attention weights, residual branches and embeddings."""
    bias: Optional[bool] = None
    """Use biases in Linear and LayerNorm layers (default: gpt2 yes; llama has none)."""
    n_kv_head: Optional[int] = None
    """llama: key/value heads, each shared by n_head / n_kv_head query heads (default n_head: no sharing)."""
    ffn_hidden: Optional[int] = None
    """llama: width of the SwiGLU MLP (default 8/3 n_embed, rounded up to a multiple of 64)."""
    tie_embeddings: Optional[bool] = None
    """The head reuses the token embedding matrix (default: gpt2 yes, llama no)."""
    gelu: Literal["exact", "tanh"] = "exact"
    """gpt2: the MLP's GELU, exact or OpenAI GPT-2's tanh approximation (for checkpoints imported from it)."""
    rope_theta: float = 10000.0
    """llama: base of the rotary embedding's frequencies."""
    norm_eps: float = 1e-5
    """llama: RMSNorm epsilon."""
    weights_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype the weights, and so their gradients, are kept in: fp32, or bf16 (pure bf16: 2 bytes a weight and 2 a
    gradient, every op in bf16; the optimizer steps each parameter in fp32 and rounds the result into its bf16
    weights, stochastically by default: --optim.rounding). One process, DDP, FSDP or tensor parallelism; not yet over
    pipeline stages."""
    mup_base_width: int = 0
    """muP (Yang et al. 2022, "Tensor Programs V"): the width of the base shape whose learning rate and initialisation
    this one inherits (0: off, the standard parametrisation). Wider by m = n_embed / base: the hidden matrices drawn
    with std / sqrt(m), their AdamW (or Muon) learning rate / m and weight decay x m, the head's input x 1 / m. At the
    base shape the model, its gradients and its steps are the standard parametrisation's, exactly."""
    mup_base_depth: int = 0
    """CompleteP (Dey et al. 2025), muP's rule for depth: the base shape's blocks (0: off). Each residual branch's output
    is scaled by base / n_blocks (alpha 1: the learning rate then transfers across depth unchanged), and the
    projections into the residual drawn as at the base depth."""

    def __post_init__(self) -> None:
        require_finite(self, "model.")
        require_positive_ints(self, ("vocab_size", "context_length", "n_embed", "n_head", "n_blocks"), "model.")
        if self.n_embed % self.n_head != 0:
            raise UserError(
                f"model.n_embed ({self.n_embed}) must be divisible by model.n_head ({self.n_head}); "
                "change --model.n-embed or --model.n-head"
            )
        llama = self.arch == "llama"
        if llama and self.bias:
            raise UserError("Llama blocks have no biases: drop --model.bias (or use --model.arch gpt2)")
        require_positive_ints(self, tuple(n for n in ("n_kv_head", "ffn_hidden") if getattr(self, n) is not None), "model.")
        if self.n_head % self.kv_heads:
            raise UserError(f"model.n_kv_head ({self.n_kv_head}) must divide model.n_head ({self.n_head}); "
                             "change --model.n-kv-head")
        if not llama and (self.kv_heads != self.n_head or self.mlp_hidden != 4 * self.n_embed):
            raise UserError("--model.n-kv-head and --model.ffn-hidden are for --model.arch llama; GPT-2 blocks have "
                             "one key/value head per query head and a 4x MLP")
        if llama and (self.n_embed // self.n_head) % 2:
            raise UserError(f"rotary embeddings need an even head size; n_embed / n_head is {self.n_embed // self.n_head} "
                             "(change --model.n-embed or --model.n-head)")
        if not self.rope_theta > 0 or not self.norm_eps > 0:
            raise UserError("model.rope_theta and model.norm_eps must be positive (set --model.rope-theta / --model.norm-eps)")
        for name in ("mup_base_width", "mup_base_depth"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UserError(f"model.{name} must be 0 (off) or a positive integer, got {value!r} "
                                f"(set --model.{name.replace('_', '-')})")
        if not 0.0 <= self.dropout < 1.0:
            raise UserError(f"model.dropout must be in [0, 1), got {self.dropout} (set --model.dropout)")

    # The settings whose default depends on the architecture, resolved (the fields keep None when unset, so that
    # switching --model.arch changes them too).
    @property
    def has_bias(self) -> bool:
        return self.arch == "gpt2" if self.bias is None else self.bias

    @property
    def tied(self) -> bool:
        return self.arch == "gpt2" if self.tie_embeddings is None else self.tie_embeddings

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def mlp_hidden(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-8 * self.n_embed // 3 // 64) * 64 if self.arch == "llama" else 4 * self.n_embed

    @property
    def width_mult(self) -> float:
        """muP's m: how many times the base shape's width this one is (1 without muP)."""
        return self.n_embed / self.mup_base_width if self.mup_base_width else 1.0

    @property
    def branch_mult(self) -> float:
        """CompleteP's residual branch multiplier, base depth / depth (1 without it)."""
        return self.mup_base_depth / self.n_blocks if self.mup_base_depth else 1.0

    @property
    def head_dim(self) -> int:
        return self.n_embed // self.n_head
