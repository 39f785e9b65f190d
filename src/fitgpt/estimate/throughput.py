"""A whole training step timed for real on the device at hand: what a run there will do, measured."""

from __future__ import annotations

import statistics
import time

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import TrainConfig
from fitgpt.device import autocast, autocast_dtype
from fitgpt.estimate.source import OwnModel
from fitgpt.estimate.timing import timed, token_batches
from fitgpt.optim import build_optimizer
from fitgpt.step import grad_scaler, train_step


def measured_tokens_per_s(cfg: TrainConfig, device: torch.device, steps: int = 3, min_seconds: float = 1.5) -> float:
    """Tokens a second of ``cfg``'s whole training step (its model, micro-batch x accumulation, precision,
    checkpointing and optimizer) on ``device``: the median of real steps after two of warm-up (``steps`` at least, and
    as many more as fit in ``min_seconds``, up to 50), on seeded random
    tokens. What a run on this machine will do, without the per-op model's dispatch overhead: the ladder sizes its
    runs by it, and fit --time-budget times each row's chosen configuration with it on the device at hand."""
    dtype = autocast_dtype(cfg.precision, device)
    torch.manual_seed(cfg.seed)
    model = OwnModel(cfg.model).build().to(device).train()
    if cfg.activation_checkpointing not in ("none", "auto"):
        apply_activation_checkpointing(model, cfg.activation_checkpointing)
    optimizer = build_optimizer(model, cfg.optim, device)
    batches = token_batches(cfg.model.vocab_size, cfg.grad_accum, cfg.batch_size, cfg.model.context_length, device, cfg.seed)
    kw = {"amp": autocast(device, dtype), "scaler": grad_scaler(device, dtype), "grad_clip": cfg.optim.grad_clip}
    def step() -> float:
        return timed(lambda: train_step(model, optimizer, batches, **kw), device)

    step(), step()  # warm-up: the optimizer's state, the allocator's blocks
    seconds, t0 = [], time.perf_counter()
    while len(seconds) < steps or (len(seconds) < 50 and time.perf_counter() - t0 < min_seconds):
        seconds.append(step())
    return cfg.batch_size * cfg.grad_accum * cfg.model.context_length / statistics.median(seconds)
