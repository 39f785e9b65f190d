"""A sharded model's weights and optimizer state gathered whole, in the single-process format, for the tests that
compare ranks with one process (moved from ``fitgpt.train.distributed``, which uses them nowhere: issue 47). Importable
from torchrun's helper scripts too: ``test_distributed.torchrun`` puts this folder on their path."""

from __future__ import annotations

import torch
import torch.nn as nn


def _gathered(t, keep: bool):
    """One tensor gathered whole (a collective: every rank calls it), kept in host memory only where ``keep``: the
    other ranks hold one gathered tensor at a time, never the whole state."""
    from fitgpt.parallel.placement import gather_whole

    full = gather_whole(t)
    return full.detach().cpu() if keep else None


def full_model_state(model: nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU on the ranks that ``keep`` them (rank 0 under FSDP; a collective: call it on
    every rank); an empty dict on the others."""
    gathered = {k: _gathered(v, keep) for k, v in model.state_dict().items()}
    return gathered if keep else {}


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool = True) -> dict | None:
    """``optimizer.state_dict()`` with sharded states gathered whole, the single-process format, on the ranks that
    ``keep`` it (a collective); None on the others."""
    sd = optimizer.state_dict()
    state = {i: {k: _gathered(v, keep) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for i, s in sd["state"].items()}
    return {**sd, "state": state} if keep else None
