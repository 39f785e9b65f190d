"""Profiling without memory or compute: PyTorch's fake tensors carry shapes, dtypes and devices, no data.

A model is built on the meta device (nothing allocated, no initialisation run) and its parameters and
buffers are then replaced by fake tensors on the device being planned for, ties kept. Every op then
runs its meta kernel under ``FakeTensorMode``: the same storages are created and freed as in a real
step, so ``LiveMemory``, ``SavedTensors`` and ``OpFlops`` read the same numbers, in seconds and with no
memory, for a model of any size.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode()


def fake_module(module: nn.Module, device: torch.device, mode: FakeTensorMode) -> nn.Module:
    """Replace ``module``'s (meta) parameters and buffers, in place, by fake ones on ``device``.

    A tensor shared by two modules (a tied head) stays one tensor. Returns ``module``.
    """
    made: dict[int, torch.Tensor] = {}
    with mode:
        for sub in module.modules():
            for table in (sub._parameters, sub._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    if id(t) not in made:
                        fake = torch.empty(t.shape, dtype=t.dtype, device=device)
                        made[id(t)] = nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake
                    table[name] = made[id(t)]
    return module


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor)
