"""`fitgpt generate`: sample from a trained run with its own tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import tyro

from fitgpt.device import resolve_device
from fitgpt.errors import UserError
from fitgpt.sample import sample_text
from fitgpt.train.load import load_run


@dataclass
class GenerateConfig:
    """Sample text from a trained run."""

    run: str = "runs/tiny"
    """Run directory written by `fitgpt train`."""
    prompt: str = ""
    """Text to continue; empty starts a fresh document."""
    max_new_tokens: int = 200
    temperature: float = 0.8
    """Softmax temperature; 0 picks the most likely token."""
    top_k: Optional[int] = 50
    """Sample only from the k most likely tokens (None: all)."""
    seed: int = 1337
    num_samples: int = 1
    checkpoint: str = "latest"
    """'latest' or a checkpoint directory of the run."""
    device: str = "auto"
    cache: bool = True
    """Keep each layer's keys and values (--no-cache recomputes the whole prefix for every token, for comparison)."""

    def __post_init__(self) -> None:
        try:
            self.prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise UserError("--prompt is not valid UTF-8 text; pass the prompt as UTF-8") from None
        if self.max_new_tokens <= 0:
            raise UserError("max_new_tokens must be positive (set --max-new-tokens)")
        if not 0 <= self.temperature < float("inf"):
            raise UserError(f"temperature must be a finite number >= 0, got {self.temperature} (set --temperature)")
        if self.top_k is not None and self.top_k <= 0:
            raise UserError("top_k must be positive (set --top-k)")
        if self.num_samples <= 0:
            raise UserError("num_samples must be positive (set --num-samples)")


def run(args: list[str]) -> int:
    cfg = tyro.cli(GenerateConfig, args=args, prog="fitgpt generate")
    model, tokenizer, _ = load_run(cfg.run, cfg.checkpoint, resolve_device(cfg.device))
    texts = sample_text(model, tokenizer, cfg.prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.seed, cfg.num_samples,
                        use_cache=cfg.cache)
    for i, text in enumerate(texts):
        if cfg.num_samples > 1:
            print(f"----- sample {i} -----")
        print(text)
    return 0
