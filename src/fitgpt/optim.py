"""AdamW with weight decay on matrices only, and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fitgpt.config import OptimConfig


def _groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]


def optimizer_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters in the optimizer's order: the indices of its saved state refer to this list."""
    decay, no_decay = _groups(model)
    return decay + no_decay


def optimizer_impl(cfg: OptimConfig, device: torch.device) -> str:
    """The AdamW implementation that steps on ``device``: ``cfg.impl``, auto resolved (fused on CUDA)."""
    return cfg.impl if cfg.impl != "auto" else ("fused" if device.type == "cuda" else "for-loop")


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over ``model`` as it steps on ``device`` (its implementation: ``cfg.impl``)."""
    decay, no_decay = _groups(model)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    impl = optimizer_impl(cfg, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=impl == "fused",
                             foreach=impl == "foreach")


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then cosine decay to cfg.min_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, max_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
