"""A training step cut into segments, with the bytes and FLOPs of each: what the planner composes.

``profile_step`` runs one real step (forward, backward, optimizer step) under ``LiveMemory`` and
``OpFlops`` and puts marks at the boundaries of every block, forward and backward:

    forward:  embed | block 0 | block 1 | ... | block N-1 | head + loss
    backward: head + loss | block N-1 | ... | block 0 | embed       then: optimizer step

Forward boundaries come from module hooks on the block list's positions; backward boundaries
from tensor hooks on each block's input and output (a tensor hook fires when that tensor's
gradient is complete, i.e. exactly when the backward of the block that consumes it ends).
For each segment we keep the live bytes at its start and end, its peak, and its FLOPs.
The optimizer segment is the trainer's own ``optimizer_update`` (clipping included);
``measure_train_step`` measures the shared ``train_step`` itself, to check predictions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from fitgpt.activation_checkpoint.apply import find_blocks
from fitgpt.memory.flops import OpCost, OpFlops
from fitgpt.memory.measure import default_loss
from fitgpt.memory.tracker import LiveMemory, round_up, storages
from fitgpt.step import Batch, optimizer_update, train_step


@dataclass
class Segment:
    start: int
    """Live bytes (above the step's baseline) when the segment began."""
    end: int
    peak: int
    flops: int
    seconds: float = 0.0
    """Its ops' time by the cost model given to ``profile_step`` (0 without one)."""
    attention: tuple = ()
    """Its attention kernel calls, as ``OpFlops.attention`` records them."""

    @property
    def rise(self) -> int:
        """How far above its starting level the segment peaked."""
        return self.peak - self.start

    @property
    def delta(self) -> int:
        """Bytes the segment leaves behind (negative when it frees more than it allocates)."""
        return self.end - self.start


@dataclass
class StepTimeline:
    """The segments of one step. ``fwd_blocks[i]``/``bwd_blocks[i]`` belong to block i."""

    fwd_embed: Segment
    fwd_blocks: list[Segment]
    fwd_head: Segment
    bwd_head: Segment
    bwd_blocks: list[Segment]
    bwd_embed: Segment
    optimizer: Segment
    fwd_transient: list[int]
    """Per block: bytes its forward allocated that were freed when the forward ended (autocast's cache of
    low-precision weight copies, not saved for backward where the block is recomputed)."""
    block_out: list[int]
    """Per block: the bytes of its output (the hidden states the next block reads)."""
    inputs_freed_at_forward_end: int
    """Bytes made before the first block that died as the forward ended (a mask or position ids every block read,
    which no saved tensor held; a checkpointed block holds them as its inputs until its backward)."""
    peak: int
    """Peak live bytes of the whole step above its baseline."""
    flops: int
    baseline: int = 0
    """Bytes already held when the step began (parameters, optimizer state, gradients if any)."""


def unique_bytes(tensors, round_to: int = 1) -> int:
    """Bytes of the distinct storages holding ``tensors`` (each rounded up to ``round_to``)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            for st in storages(t):  # a DTensor: this rank's shard
                seen[st._cdata] = round_up(st.nbytes(), round_to)  # the storage's identity: fake storages have no data pointer
    return sum(seen.values())


def model_tensors(model: nn.Module) -> list[torch.Tensor]:
    """What a model holds on its device: its parameters, then its buffers (a causal mask, rotary tables)."""
    return [*model.parameters(), *model.buffers()]


def param_bytes(model: nn.Module, round_to: int = 1) -> int:
    """Bytes of the model's parameters and buffers, each storage once."""
    return unique_bytes(model_tensors(model), round_to)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Every tensor in the optimizer's state, and those its state's objects hold (GaLore's projector, its matrix);
    none without an optimizer."""
    if optimizer is None:
        return []
    values = [v for state in optimizer.state.values() for v in state.values()]
    held = [w for v in values if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor) for w in vars(v).values()]
    return [v for v in values + held if isinstance(v, torch.Tensor)]


def grad_bytes(model: nn.Module, round_to: int = 1) -> int:
    return unique_bytes(_grads(model), round_to)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None, round_to: int = 1) -> int:
    return unique_bytes(optimizer_state_tensors(optimizer), round_to)


class _Marks:
    """Closes a segment at each mark: the live bytes then, the peak since the last mark, the FLOPs."""

    def __init__(self, live: LiveMemory, flops: OpFlops) -> None:
        self.live, self.flops = live, flops
        # name -> (live, peak since last mark, flops, seconds so far, attention calls so far)
        self.points: dict[str, tuple[int, int, int, float, int]] = {}
        self.epochs: dict[str, int] = {}  # name -> the epoch that begins at this mark

    def __call__(self, name: str) -> None:
        self.points[name] = (self.live.current, self.live.peak, self.flops.total, self.flops.seconds,
                             len(self.flops.attention))
        self.live.reset_peak()
        self.live.epoch += 1
        self.epochs[name] = self.live.epoch

    def freed_between(self, born_after: str, born_by: str, died_after: str, died_by: str) -> int:
        """Bytes allocated between two marks and freed between two others."""
        b0, b1, d0, d1 = (self.epochs[m] for m in (born_after, born_by, died_after, died_by))
        return sum(n for born, died, n in self.live.frees if b0 <= born < b1 and d0 <= died < d1)

    def segment(self, first: str, last: str) -> Segment:
        a, b = self.points[first], self.points[last]
        return Segment(start=a[0], end=b[0], peak=max(b[1], a[0]), flops=b[2] - a[2], seconds=b[3] - a[3],
                       attention=tuple(self.flops.attention[a[4]:b[4]]))


def _hidden(out):
    return out[0] if isinstance(out, tuple) else out


@contextlib.contextmanager
def block_marks(block_list: Sequence[nn.Module], mark: Callable[[str], None],
                on_output: Callable[[int, torch.Tensor], None] | None = None):
    """Call ``mark(name)`` at every block boundary of the forwards and backwards run inside: ``fwd_pre_i`` and
    ``fwd_post_i`` around block i's forward, ``bwd_out_i`` as its backward begins, ``bwd_in_0`` as block 0's ends.
    ``on_output(i, hidden)``: also given each block's output as its forward ends."""
    def pre(i):
        def hook(module, args):
            if i == 0:
                x = _hidden(args)
                if isinstance(x, torch.Tensor) and x.requires_grad:
                    x.register_hook(lambda g: mark("bwd_in_0"))
            mark(f"fwd_pre_{i}")
        return hook

    def post(i):
        def hook(module, args, out):
            mark(f"fwd_post_{i}")
            h = _hidden(out)
            if on_output is not None:
                on_output(i, h)
            if isinstance(h, torch.Tensor) and h.requires_grad:
                # grad of block i's output complete = block i's backward begins (= block i+1's ends)
                h.register_hook(lambda g: mark(f"bwd_out_{i}"))
        return hook

    handles = []
    for i, mod in enumerate(block_list):
        # Outside any hooks already there (FSDP2's gather its weights before the block and free them after):
        # what they allocate belongs to the block's segment, and segments stay contiguous.
        handles.append(mod.register_forward_pre_hook(pre(i), prepend=True))
        handles.append(mod.register_forward_hook(post(i)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def profile_step(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable[[], torch.Tensor] | None = None, blocks: str | nn.ModuleList | None = None,
                 zero_grad: bool = True, grad_clip: float = 0.0, round_to: int = 1, cost: OpCost | None = None,
                 step: bool = True) -> StepTimeline:
    """Run forward, backward and (if given) the optimizer step once, cut into segments.

    ``zero_grad``: free the gradients after the step (the trainer's ``set_to_none``); False zeroes
    them in place, as between the micro-batches of gradient accumulation. ``round_to``: as ``LiveMemory``.
    ``cost``: a model of each op's seconds, summed per segment (``Segment.seconds``). ``step=False``: the
    optimizer's state is held but its step not taken (its segment empty), as when another run measures it.
    """
    loss_fn = loss_fn or default_loss(model, idx, targets)
    _, block_list = find_blocks(model, blocks)
    n = len(block_list)
    outs = [0] * n
    baseline = param_bytes(model, round_to) + grad_bytes(model, round_to) + optimizer_state_bytes(optimizer, round_to)

    def output(i, h):
        outs[i] = unique_bytes([h], round_to)

    with OpFlops(cost) as fc, LiveMemory(round_to) as live:
        live.watch(optimizer_state_tensors(optimizer))  # in the baseline; a state tensor the step replaces is freed
        mark = _Marks(live, fc)
        with block_marks(block_list, mark, output):
            mark("start")
            loss = loss_fn()
            mark("fwd_end")
            (loss / 1).backward()  # as train_step: the loss over the micro-batches, a scalar held through backward
            mark("bwd_end")
            if optimizer is not None and step:
                optimizer_update(model, optimizer, loss.detach(), grad_clip=grad_clip, check=False)
            model.zero_grad(set_to_none=zero_grad)  # False: zeroed in place, still allocated
            del loss
            mark("opt_end")
    missing = [name for name in [f"bwd_out_{i}" for i in range(n)] + ["bwd_in_0"] if name not in mark.points]
    if missing:
        raise ValueError(f"the step did not pass through every block as a chain (no {missing[0]}): "
                         "profile_step needs blocks called in order, each on the previous one's output")
    s = mark.segment
    # A block's forward runs from the previous block's end: what is freed between two blocks (an input the next one
    # did not keep, once FSDP's hook has cast it) is the next block's doing, and the segments stay contiguous.
    starts = ["fwd_pre_0"] + [f"fwd_post_{i}" for i in range(n - 1)]
    return StepTimeline(
        fwd_embed=s("start", "fwd_pre_0"),
        fwd_blocks=[s(starts[i], f"fwd_post_{i}") for i in range(n)],
        fwd_head=s(f"fwd_post_{n - 1}", "fwd_end"),
        bwd_head=s("fwd_end", f"bwd_out_{n - 1}"),
        bwd_blocks=[s(f"bwd_out_{i}", f"bwd_out_{i - 1}" if i else "bwd_in_0") for i in range(n)],
        bwd_embed=s("bwd_in_0", "bwd_end"),
        optimizer=s("bwd_end", "opt_end"),
        fwd_transient=[mark.freed_between(starts[i], f"fwd_post_{i}", f"fwd_post_{n - 1}", "fwd_end") for i in range(n)],
        block_out=outs,
        inputs_freed_at_forward_end=mark.freed_between("start", "fwd_pre_0", f"fwd_post_{n - 1}", "fwd_end"),
        peak=max(p[1] for p in mark.points.values()),
        flops=fc.total,
        baseline=baseline,
    )


@dataclass
class StepPeak:
    """Measured memory of one optimizer step, in bytes. ``peak`` counts everything the step holds."""

    peak: int
    params: int
    grads: int
    optimizer: int
    source: str
    """``cuda-allocator`` (torch.cuda.max_memory_allocated) or ``tracker`` (live tensor storages)."""


class PeakProbe:
    """Measures the peak of the code it wraps, plus what parameters, gradients and optimizer state held
    on entry: ``with PeakProbe(model, optimizer) as probe: ...``, then ``probe.result``.

    On CUDA the allocator's peak; elsewhere the live-tensor tracker (the process RSS would count the
    allocator's caches and the Python heap, not tensors).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 also: Sequence[torch.Tensor] = (), round_to: int = 1, allocator=None) -> None:
        """``also``: tensors held across steps besides the model's and the optimizer's (a pipeline's receive
        buffers), counted as held. ``round_to``: off CUDA, each storage counted as an allocator of blocks that size
        hands it out (512: a CUDA card's, planned on fake tensors). ``allocator``: off CUDA, sees each allocation and
        free, as ``LiveMemory`` takes it (the held tensors first)."""
        self.model, self.optimizer, self.also, self.round_to = model, optimizer, list(also), round_to
        self.allocator = allocator
        self.device = next(model.parameters()).device
        self.result: StepPeak | None = None

    def __enter__(self) -> PeakProbe:
        r = self.round_to
        self._params, self._opt = param_bytes(self.model, r), optimizer_state_bytes(self.optimizer, r)
        self.held = self._params + self._opt + grad_bytes(self.model, r) + unique_bytes(self.also, r)
        """Bytes held on entry: weights, gradients, optimizer state, ``also``."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._live = LiveMemory(self.round_to, self.allocator).__enter__()
            self._live.hold([*model_tensors(self.model), *_grads(self.model), *optimizer_state_tensors(self.optimizer),
                             *self.also])
            self._live_held = self._live.current
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            rise, source = torch.cuda.max_memory_allocated(self.device) - self._base, "cuda-allocator"
        else:
            self._live.__exit__(*exc)
            rise, source = self._live.peak - self._live_held, "tracker"
        grads = unique_bytes((p for p in self.model.parameters() if p.requires_grad), self.round_to)  # mirror the params
        self.result = StepPeak(peak=self.held + rise, params=self._params, grads=grads, optimizer=self._opt, source=source)


def measure_train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch], **step_kw) -> StepPeak:
    """The peak of the shared ``train_step`` (``step_kw``: its amp, scaler, grad_clip). Run it after a first
    step, so that the optimizer state exists as it does for the rest of training."""
    with PeakProbe(model, optimizer) as probe:
        train_step(model, optimizer, batches, **step_kw)
    return probe.result
