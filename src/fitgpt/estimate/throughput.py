"""A whole training step timed for real on the device at hand: what a run there will do, measured."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import TrainConfig
from fitgpt.device import autocast, autocast_dtype
from fitgpt.estimate.source import OwnModel, with_float8
from fitgpt.estimate.timing import timed, token_batches
from fitgpt.optim import build_optimizer
from fitgpt.step import grad_scaler, train_step


@dataclass(frozen=True)
class Throughput:
    """A step timed for real: its median tokens/s, how far its steps spread, and how long the timing took."""

    tokens_per_s: float
    spread: float
    """Half the interquartile range of the steps' times, over their median (0.03: steps within about 3%)."""
    seconds: float
    """The timing's own wall time: the model built, two steps of warm-up, the steps timed."""
    steps: int


def measured_tokens_per_s(cfg: TrainConfig, device: torch.device, steps: int = 3, min_seconds: float = 1.5) -> float:
    """Tokens a second of ``cfg``'s whole training step (`measure_throughput`'s median)."""
    return measure_throughput(cfg, device, steps, min_seconds).tokens_per_s


def measure_throughput(cfg: TrainConfig, device: torch.device, steps: int = 3, min_seconds: float = 1.5) -> Throughput:
    """``cfg``'s whole training step (its model, micro-batch x accumulation, precision, checkpointing and optimizer)
    timed on ``device``: the median of real steps after two of warm-up (``steps`` at least, and as many more as fit in
    ``min_seconds``, up to 50), on seeded random tokens, and their spread. What a run on this machine will do, as busy
    as it is now, without the per-op model's dispatch overhead: the ladder sizes its runs by it, and fit
    --time-budget times each row's chosen configuration with it on the device at hand."""
    t_start = time.perf_counter()
    dtype = autocast_dtype(cfg.precision, device)
    torch.manual_seed(cfg.seed)
    model = with_float8(OwnModel(cfg.model), cfg.float8).build().to(device).train()
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
    median = statistics.median(seconds)
    q1, _, q3 = statistics.quantiles(seconds, n=4, method="inclusive")
    tokens = cfg.batch_size * cfg.grad_accum * cfg.model.context_length
    return Throughput(tokens / median, (q3 - q1) / 2 / median, time.perf_counter() - t_start, len(seconds))
