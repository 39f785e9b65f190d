"""Pure bf16 weights (``--model.weights-dtype bf16``): the optimizer's update computed in fp32, a parameter at a time,
and rounded into the bf16 weights, stochastically by default.

Any optimizer (AdamW, Adafactor, ...) steps an fp32 stand-in of each parameter, filled for its step: the weight and
its gradient upcast, the inner optimizer's step, then the result rounded back. Rounded to nearest, an update smaller
than half a bf16 step (1/256 of the weight) is lost every time; rounded stochastically, up or down with the
probabilities that make the rounding unbiased, it is kept on average (the random bits come from a generator of this
optimizer's own, seeded from the run's seed and saved in its state dict, so a resumed run is bitwise the same).
Compensated (Kahan) summation keeps it exactly instead: the weight rounded to nearest, and what the rounding lost kept
in a bf16 tensor of the parameter's shape (2 bytes a parameter, saved with the optimizer's state), added to the
weight before its next step.

The inner optimizer keeps its state for the stand-ins, in its own dtype (AdamW: fp32 moments; Adafactor: a row and
a column). Between steps a stand-in holds no memory; during one, one parameter's fp32 weight and gradient, and the
inner step's temporaries, exist: the planner measures them as it measures any step. Its state dict is the inner
optimizer's, indexed as the parameters are, plus the generator's state under ``ROUNDING_RNG``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

ROUNDING_RNG = "rounding_rng"
COMPENSATION = "kahan_compensation"


@torch.no_grad()
def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) in bf16, rounded up or down at random so that the expected value is ``x``: 16 random bits added
    below bf16's last bit, then cut off (a bf16 is an fp32's upper 16 bits)."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16, generator=generator)
    return bits.add(noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # the cut is exact


class Bf16Weights:
    """An optimizer over bf16 parameters that steps each in fp32 (``make``: the inner optimizer, for groups of fp32
    parameters) and rounds the result: ``stochastic`` (default) or to nearest."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer],
                 generator: torch.Generator | None, kahan: bool = False) -> None:
        """``generator``: the random bits of stochastic rounding (``rounding_generator``; shared by the optimizers of
        one model's parameters stepped in the backward); None rounds to nearest, and ``kahan`` keeps what that
        rounding lost (a bf16 tensor a parameter, ``COMPENSATION`` in its inner state) to add back the next step."""
        self.params = [p for g in groups for p in g["params"]]
        self.stand_in = {p: nn.Parameter(torch.empty(0, dtype=torch.float32, device=p.device)) for p in self.params}
        for p, s in self.stand_in.items():
            s.stands_for = p  # what an optimizer that numbers parameters (APOLLO's seeds) numbers it by
        self.inner = make([{**g, "params": [self.stand_in[p] for p in g["params"]]} for g in groups])
        self.defaults, self.generator, self.kahan = self.inner.defaults, generator, kahan

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for p in self.params:
            if p.grad is not None:
                self._step_param(p)

    def _step_param(self, p: torch.Tensor) -> None:
        s = self.stand_in[p]
        s.data, s.grad = p.float(), p.grad.float()  # this parameter's fp32 weight and gradient, for its step only
        lost = self.inner.state[s].get(COMPENSATION) if self.kahan else None
        if lost is not None:
            s.data.add_(lost)  # the weight as it would be, had no rounding lost anything
        self.inner.step()  # steps s alone: the other stand-ins have no gradient
        if self.generator is not None:
            p.copy_(round_stochastic(s.data, self.generator))
        else:
            p.copy_(s.data)  # to nearest
        if self.kahan:  # what that rounding lost, exact in fp32, kept to bf16's precision
            if lost is None:
                lost = self.inner.state[s][COMPENSATION] = torch.empty_like(p)
            lost.copy_(s.data.sub_(p))
        s.data, s.grad = torch.empty(0, dtype=torch.float32, device=p.device), None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        return {p: self.inner.state[s] for p, s in self.stand_in.items() if s in self.inner.state}

    def state_dict(self) -> dict:
        rng = {ROUNDING_RNG: self.generator.get_state()} if self.generator is not None else {}
        return {**self.inner.state_dict(), **rng}

    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's state, or a plain one's (an fp32-weight checkpoint: the generator starts afresh)."""
        rng = state_dict.get(ROUNDING_RNG)
        if rng is not None and self.generator is not None:
            self.generator.set_state(rng)
        self.inner.load_state_dict({k: v for k, v in state_dict.items() if k != ROUNDING_RNG})
        for p, s in self.stand_in.items():  # loaded in the stand-in's fp32, as optimizers load state: kept in bf16
            state = self.inner.state.get(s, {})
            if COMPENSATION in state:
                state[COMPENSATION] = state[COMPENSATION].to(p.dtype)


def rounding_generator(params: list[torch.Tensor]) -> torch.Generator:
    """The generator of stochastic rounding's bits, on the parameters' device, seeded from the run's seed (a stream
    other than its dropout's; no draw from the global RNG, which would move the run's dropout)."""
    device = params[0].device if params else torch.device("cpu")
    generator = torch.Generator(device="cpu" if device.type == "meta" else device)
    return generator.manual_seed(torch.initial_seed() + 1)
