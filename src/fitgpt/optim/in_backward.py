"""The optimizer step inside the backward: each parameter steps as soon as its gradient is complete, and its gradient
is freed there, so no two parameters' gradients need to be held at once (4 bytes a parameter at the peak, fp32).

One optimizer per parameter, stepped from ``register_post_accumulate_grad_hook`` (PyTorch's recipe for this, as in
torchtune's ``optimizer_in_bwd``). It answers the calls the training step and the checkpoints make of an optimizer:
``param_groups`` (the schedule sets their lr), ``state``, and ``state_dict``/``load_state_dict`` in the format of one
optimizer over all the parameters, so a checkpoint resumes with or without it.

The step is taken before any global quantity is known. Clipping by the global norm is therefore exact in two passes
(``fitgpt.step.train_step`` runs them): a first forward and backward only takes each gradient's norm and drops it
(``collecting_norms``), a second, with the RNG as the first found it, scales each gradient by the clipping
coefficient of their total and steps (``clip_by``): the weights of clip_grad_norm_ and a step after it, bit for bit,
for twice the forward and backward. Accumulation and skipping a bad step are refused by the config.

Over parameters split across ranks (FSDP2 runs each sharded parameter's hook once its gradient is reduce-scattered, as
torchtitan's step in the backward relies on; tensor parallelism's DTensor parameters accumulate as any leaf) each hook
steps what `fitgpt.optim.build_optimizer` made for that parameter: AdamW its shard, any other optimizer the whole
matrix on its owner (`fitgpt.optim.whole`). Each rank then sees only its pieces of the gradients, so their norms are
summed over ranks, a replicated piece counted once (``local_norm``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from fitgpt.optim.lowbit import EXACT

Factory = Callable[[list[dict]], torch.optim.Optimizer]


def local_norm(grad: torch.Tensor) -> torch.Tensor:
    """The norm of this rank's piece of ``grad`` (0-d fp32), scaled so that the squares summed over every rank are the
    whole gradient's squared norm: a piece replicated over r ranks (a DTensor's ``Replicate`` placements, tensor
    parallelism's norms and biases) weighs 1/r. A plain tensor: its own norm."""
    if not hasattr(grad, "to_local"):
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    replicas = 1
    for dim, placement in enumerate(grad.placements):
        replicas *= grad.device_mesh.size(dim) if placement.is_replicate() else 1
    return torch.linalg.vector_norm(grad.to_local(), dtype=torch.float32) / replicas ** 0.5


class InBackward:
    steps_in_backward = True

    def __init__(self, groups: list[dict], make: Factory) -> None:
        """``groups``: the parameter groups one optimizer would take; ``make``: that optimizer, for a list of groups."""
        self._groups = [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in groups]
        self.optimizers = {p: make([{"params": [p], **hyper}]) for params, hyper in self._groups for p in params}
        self.defaults = next(iter(self.optimizers.values())).defaults
        self._norm_sq: torch.Tensor | None = None
        # While a first pass collects norms: each parameter's slot in a buffer kept between steps (so that the first
        # pass holds nothing the second does not: the planner profiles the second).
        self._slots: dict[torch.Tensor, int] | None = None
        self._norm_buffer: torch.Tensor | None = None
        self._clip: tuple[float, float] | None = None  # (coefficient, total norm) of the pass that steps
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self.optimizers]
        self.split = any(hasattr(p, "to_local") for p in self.optimizers)  # pieces on each rank: norms summed over them

    def _step_param(self, p: torch.Tensor) -> None:
        if self._slots is not None:  # the first of two passes: the norm only
            if self.split:
                self._norm_buffer[self._slots[p]] = local_norm(p.grad)
            else:
                torch.linalg.vector_norm(p.grad, dtype=torch.float32, out=self._norm_buffer[self._slots[p]])
            p.grad = None
            return
        if self._clip is not None:
            p.grad.mul_(self._clip[0])  # a host float: no tensor outlives the hook (the plan counts none)
        else:
            sq = local_norm(p.grad).square()
            self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq
        self.optimizers[p].step()
        p.grad = None

    @torch.no_grad()
    def create_state(self) -> None:
        """Every parameter's optimizer state, as the first step makes it: by the optimizers themselves where they can
        (torchao's), else by a step on zero gradients at learning rate 0, which leaves every weight bitwise as it was
        (a checkpoint is read into the state after the weights: a resume stays exact)."""
        for p, opt in self.optimizers.items():
            if hasattr(opt, "create_state"):
                opt.create_state()
                continue
            lrs = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
            p.grad = torch.zeros_like(p)
            self._step_param(p)
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
        self._norm_sq = None  # no gradient was applied

    def norm_buffer(self, order: list[torch.Tensor]) -> torch.Tensor:
        """The buffer of the parameters' gradient norms, one fp32 slot each in ``order`` (made on first use, then
        kept, like the optimizer's state)."""
        if self._norm_buffer is None or self._norm_buffer.numel() != len(order):
            self._norm_buffer = torch.zeros(len(order), dtype=torch.float32, device=order[0].device)
        return self._norm_buffer

    @contextlib.contextmanager
    def collecting_norms(self, order: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """A backward inside takes each parameter's gradient norm into its slot of the buffer yielded (``order``:
        the slots' parameters) and drops the gradient."""
        buffer = self.norm_buffer(order)
        self._slots = {p: i for i, p in enumerate(order)}
        try:
            yield buffer
        finally:
            self._slots = None

    def total_norm(self, norms: torch.Tensor) -> torch.Tensor:
        """The gradients' total norm from the buffer ``norms`` filled by `collecting_norms` (every rank alike)."""
        if not self.split:
            return torch.linalg.vector_norm(norms)  # as clip_grad_norm_ takes it over the parameters' norms
        sq = norms.square().sum()
        dist.all_reduce(sq)
        return sq.sqrt()

    def clip_by(self, coefficient: float, total_norm: float) -> None:
        """The next backward scales each gradient by ``coefficient`` before its step (``total_norm``: for the log)."""
        self._clip = (coefficient, total_norm)

    def take_grad_norm(self) -> torch.Tensor:
        """The norm of the gradients applied since the last call, before clipping (0-d, on the device)."""
        if self._clip is not None:
            device = next(iter(self.optimizers)).device
            (_, total), self._clip = self._clip, None
            return torch.tensor(total, dtype=torch.float32, device=device)
        norm_sq, self._norm_sq = self._norm_sq, None
        if norm_sq is None:
            return torch.zeros(())
        if self.split:
            dist.all_reduce(norm_sq)
        return norm_sq.sqrt()

    def step(self) -> None:
        """Step every parameter that holds a gradient (none after a backward: the hooks took them)."""
        for p in self.optimizers:
            if p.grad is not None:
                self._step_param(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.optimizers:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """Each parameter's optimizer state, and the gradient norms' buffer where clipping made one."""
        state = {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}
        return state | ({"grad norms": {"buffer": self._norm_buffer}} if self._norm_buffer is not None else {})

    def state_dict(self) -> dict:
        """One optimizer's state dict over all the parameters, indexed in the groups' order (with low-bit AdamW's
        exact moments, as its own state dict holds them)."""
        state, exact, groups, i = {}, {}, [], 0
        for params, hyper in self._groups:
            ids = []
            for p in params:
                sd = self.optimizers[p].state_dict()
                if sd["state"]:
                    state[i] = sd["state"][0]
                if 0 in sd.get(EXACT, {}):
                    exact[i] = sd[EXACT][0]
                ids.append(i)
                i += 1
            # A group's settings as its optimizers keep them (an empty group: as it was given).
            saved = self.optimizers[params[0]].state_dict()["param_groups"][0] if params else {**self.defaults, **hyper}
            groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups} | ({EXACT: exact} if exact else {})

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for ps, _ in self._groups for p in ps]
        exact = state_dict.get(EXACT) or {}
        for group in state_dict["param_groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for i in group["params"]:
                s = state_dict["state"].get(i, state_dict["state"].get(str(i)))
                # The group's saved settings that this parameter's optimizer has (Muon's matrices and AdamW's tables
                # share a group, each with its own settings).
                own = self.optimizers[params[i]].param_groups[0]
                mine = {k: hyper.get(k, v) for k, v in own.items() if k != "params"}
                own_exact = exact.get(i, exact.get(str(i)))
                self.optimizers[params[i]].load_state_dict({"state": {0: s} if s else {}, "param_groups": [{**mine, "params": [0]}]}
                                                           | ({EXACT: {0: own_exact}} if own_exact is not None else {}))
