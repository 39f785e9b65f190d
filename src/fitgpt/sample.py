"""Sample text from a loaded model (`fitgpt.train.load.load_run` loads a run)."""

from __future__ import annotations

import logging

import torch

from fitgpt.data.tokenizer import Tokenizer
from fitgpt.model import Transformer

log = logging.getLogger(__name__)


def sample_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float,
                top_k: int | None, seed: int, num_samples: int = 1, use_cache: bool = True) -> list[str]:
    device = next(model.parameters()).device
    ids = tokenizer.encode(prompt) if prompt else [tokenizer.eot_id]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (n, T)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=gen, use_cache=use_cache,
                         vocab_limit=tokenizer.vocab_size)
    start = len(ids) if prompt else 1
    return [prompt + tokenizer.decode(row[start:].tolist()) for row in out]
