"""A trained run, loaded: its checkpoint's model and the run's tokenizer, checked against each other. What
`fitgpt generate` samples and `fitgpt export` writes."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from fitgpt.config import from_dict
from fitgpt.data.tokenizer import Tokenizer
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer
from fitgpt.train import checkpoint as ckpt

log = logging.getLogger(__name__)


def load_run(run_dir: str | Path, checkpoint: str = "latest", device: torch.device | str = "cpu") -> tuple[Transformer, Tokenizer, dict]:
    """The model of a run's checkpoint and the run's tokenizer, checked against each other."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist (check --run)")
    path, meta = ckpt.resolve_resume(run_dir, checkpoint, flag="--checkpoint")
    model_cfg = from_dict(ModelConfig, meta["config"]["model"], str(path / ckpt.META_FILE), "model.")
    tok_path = run_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise UserError(f"{tok_path} is missing: this run directory was not written by fitgpt train")
    expected = meta.get("data", {}).get("tokenizer_sha256")
    if expected and ckpt.sha256_file(tok_path) != expected:
        raise UserError(f"{tok_path} is not the tokenizer the checkpoint {path} was trained with")
    tokenizer = Tokenizer.load(run_dir)
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UserError(f"{tok_path} has {tokenizer.vocab_size} tokens, more than the model's vocab_size {model_cfg.vocab_size}")
    model = Transformer(model_cfg)
    ckpt.load_weights(path, model, meta)
    model.to(device).eval()
    log.info("loaded %s (step %d)", path, meta["step"])
    return model, tokenizer, meta
