"""Pure bf16 weights (``--model.weights-dtype bf16``): the optimizer's update computed in fp32, a parameter at a time,
and rounded into the bf16 weights, stochastically by default.

Any optimizer (AdamW, Adafactor, ...) steps an fp32 stand-in of each parameter, filled for its step: the weight and
its gradient upcast, the inner optimizer's step, then the result rounded back. Rounded to nearest, an update smaller
than half a bf16 step (1/256 of the weight) is lost every time; rounded stochastically, up or down with the
probabilities that make the rounding unbiased, it is kept on average. The random bits of a parameter's n-th rounding
come from a generator seeded from the run's seed, the parameter's place in the model and n (kept in its state,
``ROUNDED``): the same bits whichever rank steps it and on whatever layout, so a run split across ranks rounds as one
process does, and a resumed run, on any layout, is bitwise the one that went on.
Compensated (Kahan) summation keeps it exactly instead: the weight rounded to nearest, and what the rounding lost kept
in a bf16 tensor of the parameter's shape (2 bytes a parameter, saved with the optimizer's state), added to the
weight before its next step.

The inner optimizer keeps its state for the stand-ins, in its own dtype (AdamW: fp32 moments; Adafactor: a row and
a column). Between steps a stand-in holds no memory; during one, one parameter's fp32 weight and gradient, and the
inner step's temporaries, exist: the planner measures them as it measures any step. Its state dict is the inner
optimizer's, indexed as the parameters are (each parameter's count of roundings in its state).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from fitgpt.optim.whole import StandIns, emptied, placeholder, shaped

ROUNDED = "rounded"
COMPENSATION = "kahan_compensation"


@torch.no_grad()
def round_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) in bf16, rounded up or down at random so that the expected value is ``x``: 16 random bits added
    below bf16's last bit, then cut off (a bf16 is an fp32's upper 16 bits)."""
    bits = x.view(torch.int32)
    noise = torch.randint_like(bits, 0, 1 << 16, generator=generator)
    return bits.add(noise).bitwise_and_(-65536).view(torch.float32).to(torch.bfloat16)  # the cut is exact


class Bf16Weights(StandIns):
    """An optimizer over bf16 parameters that steps each in fp32 (``make``: the inner optimizer, for groups of fp32
    parameters) and rounds the result: ``stochastic`` (default) or to nearest."""

    def __init__(self, groups: list[dict], make: Callable[[list[dict]], torch.optim.Optimizer],
                 seed: int | None, numbering: dict[int, int] | None = None, kahan: bool = False) -> None:
        """``seed``: the run's, from which stochastic rounding draws (`rounding_seed`), each parameter by its place
        in ``numbering`` (by id: its index among the model's parameters; default, its place in ``groups``); None
        rounds to nearest, and ``kahan`` keeps what that rounding lost (a bf16 tensor a parameter, ``COMPENSATION`` in
        its inner state) to add back the next step."""
        self.params = [p for g in groups for p in g["params"]]
        self.stand_in = {p: placeholder(p, torch.float32) for p in self.params}
        for p, s in self.stand_in.items():
            s.stands_for = getattr(p, "stands_for", p)  # what an optimizer that numbers parameters numbers it by
        self.inner = make([{**g, "params": [self.stand_in[p] for p in g["params"]]} for g in groups])
        emptied(self.stand_in.values())
        self.defaults, self.seed, self.kahan = self.inner.defaults, seed, kahan
        numbering = numbering or {id(p): i for i, p in enumerate(self.params)}
        self.index = {p: numbering[id(getattr(p, "stands_for", p))] for p in self.params}
        self.generator = _generator(self.params[0].device) if seed is not None and self.params else None

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
            state = self.inner.state[s]
            if ROUNDED not in state:  # a host count (a tensor, as checkpoints hold state), read without a sync
                state[ROUNDED] = torch.zeros((), dtype=torch.int64)
            if s.data.device.type != "meta" and not is_fake(s.data):  # the planner's tensors: no values to draw
                self.generator.manual_seed(_stream(self.seed, self.index[p], int(state[ROUNDED])))
            p.copy_(round_stochastic(s.data, self.generator))
            state[ROUNDED] += 1
        else:
            p.copy_(s.data)  # to nearest
        if self.kahan:  # what that rounding lost, exact in fp32, kept to bf16's precision
            if lost is None:
                lost = self.inner.state[s][COMPENSATION] = torch.empty_like(p)
            lost.copy_(s.data.sub_(p))
        s.grad = None
        emptied([s])

    def load_state_dict(self, state_dict: dict) -> None:
        """This optimizer's state, or a plain one's (an fp32-weight checkpoint: each parameter's rounding counts from
        0)."""
        with shaped(self.stand_in):  # (torchao's low-bit moments are made to the parameter's shape)
            self.inner.load_state_dict(state_dict)
        for p, s in self.stand_in.items():  # loaded in the stand-in's fp32, as optimizers load state: kept in bf16
            state = self.inner.state.get(s, {})
            if COMPENSATION in state:
                state[COMPENSATION] = state[COMPENSATION].to(p.dtype)
            if ROUNDED in state:  # loaded onto the parameter's device: the count stays on the host
                state[ROUNDED] = torch.as_tensor(state[ROUNDED], dtype=torch.int64).cpu()


def rounding_seed(seed: int | None) -> int:
    """Stochastic rounding's seed from the run's (``seed``; None: the global generator's, as seeded): a stream other
    than its dropout's (no draw from the global RNG, which would move the run's dropout)."""
    return (torch.initial_seed() if seed is None else seed) + 1


def _stream(seed: int, index: int, n: int) -> int:
    """The seed of parameter ``index``'s ``n``-th rounding."""
    return ((seed * 1_000_003 + index) * 1_000_003 + n) % 2**63


def _generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device="cpu" if device.type == "meta" else device)
