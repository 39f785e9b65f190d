"""Adafactor: PyTorch's (``torch.optim.Adafactor``), its second moment factored into a row and a column mean for each
matrix (m + n values instead of m x n: under 0.01 bytes a parameter for a 1024-wide matrix), no first moment, the step
size relative to each parameter's RMS (``min(lr, 1/sqrt(t))``, as the paper's relative step). A parameter at a time
(its for-loop implementation): the step's temporaries are one matrix's ``row_var @ col_var`` and update, fp32.

The step reads a few scalars on the host (``.item()``: the step count and two norms). The planner's fake tensors hold
no values, and no byte the step allocates depends on them, so under fake tensors those reads give 1.0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def _fake_scalars() -> Iterator[None]:
    item = torch.Tensor.item

    def read(t: torch.Tensor):
        return 1.0 if isinstance(t, FakeTensor) else item(t)

    torch.Tensor.item = read
    try:
        yield
    finally:
        torch.Tensor.item = item


class Adafactor(torch.optim.Adafactor):
    def __init__(self, params, lr: float, weight_decay: float = 0.0) -> None:
        super().__init__(params, lr=lr, weight_decay=weight_decay, foreach=False)

    @torch.no_grad()
    def step(self, closure=None):
        fake = any(isinstance(p, FakeTensor) for g in self.param_groups for p in g["params"])
        with _fake_scalars() if fake else contextlib.nullcontext():
            return super().step(closure)
