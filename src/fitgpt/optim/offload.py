"""The optimizer's state and step on the host (``--optim.offload``): the card keeps the weights and, until the
backward has copied them out, their gradients; host memory keeps an fp32 copy of each weight, its gradient and the
optimizer's moments (16 bytes a parameter with AdamW), and the host's CPU steps them.

The design is torchao's ``CPUOffloadOptimizer`` (and DeepSpeed's ZeRO-Offload before it): parameters of fewer than
4096 values stay on the card with their own optimizer (a copy each is not worth its launch); each larger one has a
pinned host twin, and its gradient is copied out on a side stream as soon as the backward completes it (a
post-accumulate-grad hook), so the copies overlap the rest of the backward; after the host step each twin is copied
back. Written here rather than wrapped, because torchao's copies each gradient out before clipping could scale it (a
clip of the card's gradients is silently not applied), keeps one state dict per parameter, and runs only with a
CUDA device present, so neither this CPU nor the planner's fake tensors could run it. Here the step clips the host's
gradients (``grad_holders``), saves one optimizer's state dict, and runs anywhere: on a CPU device the copies are
plain copies (tested bit for bit against the step it replaces). On the planner's fake tensors the host is the meta
device: what it holds and does is shaped but never counted as the card's, and the host step's time is modelled from
the bytes it reads and writes (``step_bytes``).

``free_grads`` (``--optim.in-backward`` with ``--optim.offload``) drops each card gradient once it is copied: no
gradient stays on the card, and gradients cannot accumulate over micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import is_fake

from fitgpt.memory.timeline import unique_bytes

MIN_SIZE = 4096
"""Parameters with fewer values stay on the card (torchao's ``minimal_size``): layer norms, biases."""

IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")
"""Optimizer settings that choose a kernel, not the update."""

Factory = Callable[[list[dict], torch.device], torch.optim.Optimizer]


class HostOffload:
    steps_in_backward = False

    def __init__(self, groups: list[dict], make: Factory, free_grads: bool = False) -> None:
        """``groups``: the parameter groups one optimizer would take; ``make(groups, device)``: that optimizer."""
        self.free_grads = free_grads
        self._group_sizes = [len(g["params"]) for g in groups]
        self._params = [p for g in groups for p in g["params"]]
        device = self._params[0].device
        real_cuda = device.type == "cuda" and not is_fake(self._params[0])
        self.host = torch.device("meta" if is_fake(self._params[0]) else "cpu")
        self._stream = torch.cuda.Stream(device) if real_cuda else None
        self.twin: dict[torch.Tensor, torch.Tensor] = {}
        self._host_grad: dict[torch.Tensor, torch.Tensor] = {}
        self._copied: list[torch.cuda.Event] = []
        on_host, on_card = [], []
        for g in groups:
            hyper = {k: v for k, v in g.items() if k != "params"}
            on_host.append({"params": [self._make_twin(p, real_cuda) for p in g["params"] if p.numel() >= MIN_SIZE], **hyper})
            on_card.append({"params": [p for p in g["params"] if p.numel() < MIN_SIZE], **hyper})
        self.host_optimizer = make(on_host, self.host) if self.twin else None
        self.card_optimizer = make(on_card, device) if len(self.twin) < len(self._params) else None
        self.defaults = (self.host_optimizer or self.card_optimizer).defaults | {"fused": False}  # decided on the host
        self._handles = [p.register_post_accumulate_grad_hook(self.copy_out) for p in self.twin]

    def _make_twin(self, p: torch.Tensor, pinned: bool) -> torch.Tensor:
        host = torch.empty_like(p, device=self.host, pin_memory=pinned).copy_(p.detach())
        self._host_grad[host] = torch.empty_like(host, pin_memory=pinned)
        self.twin[p] = host
        return host

    def copy_out(self, p: torch.Tensor) -> None:
        """``p``'s gradient is complete (accumulated, when it accumulates): its host twin's gradient becomes it. Each
        parameter's post-accumulate-grad hook; the planner calls it where it sets gradients by hand."""
        host = self.twin[p]
        grad = self._host_grad[host]
        if self._stream is None:
            grad.copy_(p.grad)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(p.device))  # the backward that wrote it
            with torch.cuda.stream(self._stream):
                grad.copy_(p.grad, non_blocking=True)
            self._copied.append(self._stream.record_event())
            if self.free_grads:
                p.grad.record_stream(self._stream)  # freed for reuse once the copy has read it
        host.grad = grad
        if self.free_grads:
            p.grad = None

    def _wait(self) -> None:
        for event in self._copied:
            event.synchronize()
        self._copied.clear()

    def grad_holders(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` the step applies, for each of ``params``: its host twin, or itself (clipping
        scales these; the card's copies of offloaded gradients are no longer read)."""
        self._wait()
        return [self.twin.get(p, p) for p in params]

    @torch.no_grad()
    def step(self) -> None:
        self._wait()
        if self.card_optimizer is not None:
            self.card_optimizer.step()
        if self.host_optimizer is None:
            return
        self.host_optimizer.step()
        for p, host in self.twin.items():
            if self._stream is None:
                p.copy_(host)
            else:
                with torch.cuda.stream(self._stream):
                    p.copy_(host, non_blocking=True)
        if self._stream is not None:
            torch.cuda.current_stream(self._params[0].device).wait_stream(self._stream)  # the next forward reads them

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            p.grad = None
        for host in self.twin.values():
            host.grad = None  # a parameter the next backward leaves without a gradient does not step

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in (self.host_optimizer, self.card_optimizer) if opt is not None for g in opt.param_groups]

    @property
    def state(self) -> dict:
        """The optimizer state on the card: that of the parameters too small to offload."""
        return dict(self.card_optimizer.state) if self.card_optimizer is not None else {}

    def host_bytes(self) -> int:
        """Host memory held: each offloaded weight's copy, its gradient and its optimizer state."""
        tensors = [*self.twin.values(), *self._host_grad.values()]
        if self.host_optimizer is not None:
            tensors += [v for s in self.host_optimizer.state.values() for v in s.values()]
        return unique_bytes(tensors)

    def step_bytes(self) -> int:
        """Bytes the host step reads and writes, as one pass over each tensor does (torch's fused CPU AdamW): each
        weight copy and its state read and written, its gradient read."""
        if self.host_optimizer is None:
            return 0
        total = 0
        for host in self.twin.values():
            state = self.host_optimizer.state.get(host, {})
            held = host.nbytes + sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
            total += 2 * held + self._host_grad[host].nbytes
        return total

    def _where(self) -> list[tuple[torch.optim.Optimizer, int]]:
        """For each parameter, in the groups' order: the optimizer that steps it and its index there."""
        where, counts = [], {}
        for p in self._params:
            opt = self.host_optimizer if p in self.twin else self.card_optimizer
            where.append((opt, counts.setdefault(id(opt), 0)))
            counts[id(opt)] += 1
        return where

    def state_dict(self) -> dict:
        """One optimizer's state dict over all the parameters, indexed in the groups' order."""
        inner = {id(opt): opt.state_dict()["state"] for opt in (self.host_optimizer, self.card_optimizer) if opt}
        state = {i: inner[id(opt)][j] for i, (opt, j) in enumerate(self._where()) if j in inner[id(opt)]}
        groups, first = [], 0
        for n, group in zip(self._group_sizes, (self.host_optimizer or self.card_optimizer).state_dict()["param_groups"]):
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(first, first + n))})
            first += n
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Each parameter's state to the optimizer that steps it; the groups' settings to both, each keeping its own
        implementation (the host's and the card's kernels differ)."""
        states = {id(opt): {} for opt in (self.host_optimizer, self.card_optimizer) if opt}
        for i, (opt, j) in enumerate(self._where()):
            s = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if s:
                states[id(opt)][j] = s
        for opt in (self.host_optimizer, self.card_optimizer):
            if opt is None:
                continue
            own = opt.state_dict()["param_groups"]
            groups = [{**{k: v for k, v in saved.items() if k not in IMPLEMENTATION}, **{k: mine[k] for k in IMPLEMENTATION
                       if k in mine}, "params": mine["params"]} for saved, mine in zip(state_dict["param_groups"], own, strict=True)]
            opt.load_state_dict({"state": states[id(opt)], "param_groups": groups})
        with torch.no_grad():  # the host copies are the weights the next step updates: the card's, as loaded
            for p, host in self.twin.items():
                host.copy_(p)
