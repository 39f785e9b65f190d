"""Any optimizer over parameters split across ranks (FSDP's row shards, tensor parallelism's column or row shards, or
both), stepping each parameter whole: the step one process takes, on every layout.

AdamW is elementwise, so each rank steps its own shard of every parameter (PyTorch's AdamW on DTensors). The other
optimizers are not: Muon orthogonalises a whole matrix, Adafactor factors its second moment into a row and a column,
GaLore projects it by its SVD and APOLLO by a random matrix, and torchao's low-bit AdamW quantizes its moments in blocks
that a shard's boundary would cut differently. Each of those needs the whole matrix, so each parameter is given to one
rank, its owner, as public Muon implementations for FSDP2 do (matrices assigned to ranks, largest first, to the rank
holding the least state so far): at each step, parameter by parameter, the ranks all-gather its gradient and its weight, the
owner steps it with the inner optimizer (one process's, over stand-ins of every parameter, the same indices and
groups), and broadcasts the result, of which every rank keeps its own shard.

So the arithmetic is one process's, to the bit, and only the gradients' reduction across ranks rounds differently. The
optimizer's state of a parameter lives on its owner alone, whole (on average 1/N of one process's a rank): in a
distributed checkpoint each entry is written by its owner, and read by whichever rank owns it on the layout that
resumes (any number of ranks, or one process, reads it whole). A step holds, for a moment, one parameter's whole
weight and gradient (and on its owner the inner step's temporaries): the planner measures that as it measures any
step, on rank 0, which owns the most (``owners``); stepped in the backward, on every rank that owns a matrix
(`fitgpt.estimate.heaviest`: the heaviest is the one stepping when the most is alive).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from fitgpt.optim.lowbit import EXACT

Factory = Callable[[list[dict]], torch.optim.Optimizer]


def owners(sizes: list[int], world: int) -> list[int]:
    """The rank that steps each parameter (``sizes``: the bytes of state each keeps): largest first, each to the rank that
    holds the fewest values so far; the ranks then numbered by what they hold, most first, so that rank 0 (the one the
    planner profiles) is the heaviest."""
    load, held = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        held[r].append(i)
        load[r] += sizes[i]
    owner = [0] * len(sizes)
    for rank, r in enumerate(sorted(range(world), key=lambda r: (-load[r], r))):
        for i in held[r]:
            owner[i] = rank
    return owner


def placeholder(p: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """A stand-in for ``p`` as an optimizer is built over it: its whole shape (Muon checks its matrices are 2-D), one
    value of memory; `emptied` once built."""
    return nn.Parameter(torch.empty((), dtype=dtype, device=p.device).expand(p.shape))


def emptied(stand_ins) -> None:
    """Each of ``stand_ins`` holding no memory, as between its steps."""
    for s in stand_ins:
        s.data = torch.empty(0, dtype=s.dtype, device=s.device)


@contextlib.contextmanager
def shaped(stand_in: dict) -> Iterator[None]:
    """Each stand-in (``stand_in``: by the parameter it stands for) of its parameter's whole shape while an optimizer
    loads state into it: torchao's low-bit AdamW makes its quantized moments to the parameter's shape."""
    for p, s in stand_in.items():
        s.data = placeholder(p, s.dtype).data
    try:
        yield
    finally:
        emptied(stand_in.values())


def steps_whole(name: str, bf16_weights: bool) -> bool:
    """Whether optimizer ``name`` steps each split matrix whole (on its owner): every one but AdamW, whose update is
    elementwise on any shard, and any over pure bf16 weights (their rounding draws by place)."""
    return bf16_weights or name != "adamw"


def splits(params: list[torch.Tensor]) -> bool:
    """Whether any of ``params`` is split across ranks (a DTensor: FSDP's or tensor parallelism's)."""
    return any(hasattr(p, "full_tensor") for p in params)


def sharing_ranks(params: list[torch.Tensor]) -> tuple[object, list[int]]:
    """The process group over which ``params`` are split and its ranks (the process's numbers): every process, or
    under pipeline parallelism the ranks of one stage (its data-parallel and tensor-parallel ones), whose mesh the
    parameters' DTensors name."""
    world = dist.get_world_size()
    mesh = next((p.device_mesh for p in params if hasattr(p, "device_mesh")), None)
    if mesh is None or mesh.size() == world:
        return None, list(range(world))
    from fitgpt.parallel.placement import mesh_group

    return mesh_group(mesh)


class StandIns:
    """An optimizer whose inner optimizer steps stand-ins of its parameters (``stand_in``: by parameter), filled for
    each step: answers as one optimizer over the parameters, its state dict the inner one's."""

    params: list[torch.Tensor]
    stand_in: dict[torch.Tensor, nn.Parameter]
    inner: torch.optim.Optimizer

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """Each parameter's state (held here: under `WholeMatrices`, this rank's own parameters')."""
        return {p: self.inner.state[s] for p, s in self.stand_in.items() if s in self.inner.state}

    def state_dict(self) -> dict:
        """One process's state dict (indexed over every parameter)."""
        return self.inner.state_dict()


class WholeMatrices(StandIns):
    """``make``'s optimizer over ``groups``, each parameter stepped whole by its owner (see the module)."""

    steps_in_backward = False

    def __init__(self, groups: list[dict], make: Factory, state_size: Callable[[torch.Tensor], int] = torch.numel,
                 owner: list[int] | None = None) -> None:
        """``state_size``: about how many bytes of state the optimizer keeps for a parameter, which the ranks share;
        ``owner``: each parameter's owner, where they are chosen among more parameters than these (the step in the
        backward makes one of these a parameter)."""
        self.params = [p for g in groups for p in g["params"]]
        self.group, self.ranks = sharing_ranks(self.params)
        self.rank = self.ranks.index(dist.get_rank())
        self.owner = owner or owners([state_size(p) for p in self.params], len(self.ranks))
        self.stand_in = {p: placeholder(p, p.dtype) for p in self.params}
        for p, s in self.stand_in.items():
            s.stands_for = getattr(p, "stands_for", p)  # what an optimizer that numbers parameters numbers it by
        self.inner = make([{**g, "params": [self.stand_in[p] for p in g["params"]]} for g in groups])
        emptied(self.stand_in.values())
        self.defaults = self.inner.defaults

    @torch.no_grad()
    def step(self, closure=None) -> None:
        from fitgpt.parallel.placement import assign_whole, gather_whole

        for i, p in enumerate(self.params):
            if p.grad is None:  # alike on every rank: FSDP gives each shard its gradient, or none
                continue
            grad, weight = gather_whole(p.grad), gather_whole(p.detach())  # (whole shape): collectives, every rank
            if self.owner[i] == self.rank:
                s = self.stand_in[p]
                s.data, s.grad = weight, grad
                self.inner.step()  # steps s alone: no other stand-in has a gradient
                weight = s.data
                s.grad = None
                emptied([s])
            del grad
            if not weight.is_contiguous():
                weight = weight.contiguous()
            dist.broadcast(weight, src=self.ranks[self.owner[i]], group=self.group)
            assign_whole(p, weight)

    def load_state_dict(self, state_dict: dict) -> None:
        """A state dict of this optimizer over any layout (or one process's): this rank keeps its parameters' entries
        (of its state, and of any other entry indexed by parameter: low-bit AdamW's exact moments)."""
        def mine(entries: dict) -> dict:
            return {k: v for k, v in entries.items() if self.owner[int(k)] == self.rank}

        with shaped(self.stand_in):
            self.inner.load_state_dict({k: mine(v) if k == "state" or k == EXACT else v for k, v in state_dict.items()})
