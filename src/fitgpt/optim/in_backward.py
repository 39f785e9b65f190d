"""The optimizer step inside the backward: each parameter steps as soon as its gradient is complete, and its gradient
is freed there, so no two parameters' gradients need to be held at once (4 bytes a parameter at the peak, fp32).

One optimizer per parameter, stepped from ``register_post_accumulate_grad_hook`` (PyTorch's recipe for this, as in
torchtune's ``optimizer_in_bwd``). It answers the calls the training step and the checkpoints make of an optimizer:
``param_groups`` (the schedule sets their lr), ``state``, and ``state_dict``/``load_state_dict`` in the format of one
optimizer over all the parameters, so a checkpoint resumes with or without it. The step is taken before any global
quantity is known: no clipping by the global norm, no accumulation, no skipping a bad step (the config refuses them);
the gradient norm is summed as the parameters step, for the log.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Factory = Callable[[list[dict]], torch.optim.Optimizer]


class InBackward:
    steps_in_backward = True

    def __init__(self, groups: list[dict], make: Factory) -> None:
        """``groups``: the parameter groups one optimizer would take; ``make``: that optimizer, for a list of groups."""
        self._groups = [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in groups]
        self.optimizers = {p: make([{"params": [p], **hyper}]) for params, hyper in self._groups for p in params}
        self.defaults = next(iter(self.optimizers.values())).defaults
        self._norm_sq: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._step_param) for p in self.optimizers]

    def _step_param(self, p: torch.Tensor) -> None:
        sq = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
        self._norm_sq = sq if self._norm_sq is None else self._norm_sq + sq
        self.optimizers[p].step()
        p.grad = None

    def take_grad_norm(self) -> torch.Tensor:
        """The norm of the gradients applied since the last call (0-d, on the device)."""
        norm_sq, self._norm_sq = self._norm_sq, None
        return norm_sq.sqrt() if norm_sq is not None else torch.zeros(())

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
        return {p: opt.state[p] for p, opt in self.optimizers.items() if p in opt.state}

    def state_dict(self) -> dict:
        """One optimizer's state dict over all the parameters, indexed in the groups' order."""
        state, groups, i = {}, [], 0
        for params, _ in self._groups:
            ids = []
            for p in params:
                sd = self.optimizers[p].state_dict()
                if sd["state"]:
                    state[i] = sd["state"][0]
                ids.append(i)
                i += 1
            groups.append({**{k: v for k, v in sd["param_groups"][0].items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        params = [p for ps, _ in self._groups for p in ps]
        for group in state_dict["param_groups"]:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for i in group["params"]:
                s = state_dict["state"].get(i, state_dict["state"].get(str(i)))
                self.optimizers[params[i]].load_state_dict({"state": {0: s} if s else {}, "param_groups": [{**hyper, "params": [0]}]})

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
