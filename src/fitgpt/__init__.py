"""fitgpt: train GPT-style language models from scratch, in the memory you have."""

from fitgpt.model import Block, ModelConfig, Transformer

__version__ = "0.1.0"
__all__ = ["Block", "ModelConfig", "Transformer", "__version__"]
