"""The GPT model and its config."""

from fitgpt.model.config import ModelConfig
from fitgpt.model.transformer import Block, LMHead, Transformer

__all__ = ["Block", "LMHead", "ModelConfig", "Transformer"]
