"""AdamW with its two moments stored in bf16: 4 bytes a parameter instead of 8.

PyTorch's AdamW keeps its moments in the parameter's dtype (and refuses others); torchao's low-bit AdamW compiles its
step for each parameter shape, which the planner's fake tensors cannot run. This one is eager, a parameter at a time:
the moments are read into fp32, updated there, rounded to nearest back into bf16, and the update is computed from the
fp32 values. Its temporaries are two fp32 copies of one parameter's moments at a time, measured by the planner like
any other op's. Same hyperparameters and order of operations as ``torch.optim.AdamW(foreach=False)``.
"""

from __future__ import annotations

import math

import torch

STATE_DTYPE = torch.bfloat16


class AdamWBf16(torch.optim.Optimizer):
    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_param(p, p.grad, group)

    def _step_param(self, p: torch.Tensor, grad: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if not state:
            # The step count as PyTorch's AdamW keeps it (a 0-d fp32 tensor on the host), so checkpoints load either way.
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=STATE_DTYPE, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=STATE_DTYPE, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        p.mul_(1 - lr * wd)  # decoupled weight decay
        m = state["exp_avg"].float().lerp_(grad, 1 - beta1)  # fp32 copies of this parameter's moments
        v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
        denom = v.sqrt_().div_(math.sqrt(1 - beta2**step)).add_(eps)
        p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads any AdamW's state (an fp32-moment checkpoint included): PyTorch casts the moments to the parameter's
        dtype on loading, so they are rounded to bf16 here."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(STATE_DTYPE)
