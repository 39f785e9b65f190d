"""The model's shape, as one typed dataclass that validates itself."""

from __future__ import annotations

from dataclasses import dataclass


def require_positive_ints(obj: object, names: tuple[str, ...], section: str = "") -> None:
    """Raise ValueError naming the field and its flag when one of ``names`` is not a positive int."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            flag = f"--{section}{name.replace('_', '-')}"
            raise ValueError(f"{section}{name} must be a positive integer, got {value!r} (set {flag})")


@dataclass
class ModelConfig:
    """Shape of the GPT model."""

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
    bias: bool = True
    """Use biases in Linear and LayerNorm layers (GPT-2 does)."""

    def __post_init__(self) -> None:
        require_positive_ints(self, ("vocab_size", "context_length", "n_embed", "n_head", "n_blocks"), "model.")
        if self.n_embed % self.n_head != 0:
            raise ValueError(
                f"model.n_embed ({self.n_embed}) must be divisible by model.n_head ({self.n_head}); "
                "change --model.n-embed or --model.n-head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout} (set --model.dropout)")
