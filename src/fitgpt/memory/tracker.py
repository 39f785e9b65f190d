"""Counting memory on any device: live tensor storages, and what autograd saves for backward.

``LiveMemory`` is a ``TorchDispatchMode`` that sees every storage an op creates and notices when it
is freed, so it gives the bytes alive at any moment and their peak, on CPU as on CUDA.
``SavedTensors`` counts the unique storages packed by ``saved_tensors_hooks``: what autograd keeps
outside checkpoint regions (the regions' boundaries included); a region's own internals are held
by the checkpoint machinery and are counted by ``LiveMemory`` instead.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

_DEVICE = torch.ops.prim.device.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_LIFT = torch.ops.aten.lift_fresh.default  # a view by its schema, but a fake mode makes a new fake tensor of a constant


def round_up(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding ``t``'s data: its own, or for a tensor subclass that wraps others (a DTensor: this
    rank's shard), theirs. A wrapper's own storage reports the whole (global) size and holds nothing."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [st for name in names if isinstance(inner := getattr(t, name), torch.Tensor) for st in storages(inner)]
    return [t.untyped_storage()]


class LiveMemory(TorchDispatchMode):
    """Bytes of tensor storages created inside the mode and still alive; ``peak`` is their maximum.

    ``round_to``: count each storage as an allocator would hand it out (512 for CUDA's caching
    allocator, whose ``max_memory_allocated`` counts whole blocks); 1 counts exact bytes.
    ``allocator``: also replay each allocation and free, in order, through a model of an allocator
    (anything with ``malloc(key, nbytes)`` and ``free(key)``).
    """

    def __init__(self, round_to: int = 1, allocator=None) -> None:
        super().__init__()
        self.round_to = round_to
        self.allocator = allocator
        self.epoch = 0
        """Set by the caller (a segment number): each free is logged with the epochs of its birth and death."""
        self.frees: list[tuple[int, int, int]] = []
        """(epoch allocated, epoch freed, bytes) of every storage freed while the mode was active."""
        self._born: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self.op = None
        """The op whose outputs are being counted (a snapshot's frames name it)."""

    def _free(self, key: int) -> None:
        nbytes = self._live.pop(key, None)
        if nbytes is not None:
            self.current -= nbytes
            self.frees.append((self._born.pop(key), self.epoch, nbytes))
            if self.allocator is not None:
                self.allocator.free(key)

    def _track(self, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key in self._live:
            return
        if self.allocator is not None:
            self.allocator.malloc(key, st.nbytes())
        nbytes = round_up(st.nbytes(), self.round_to)
        self._live[key] = nbytes
        self._born[key] = self.epoch
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)  # on a resized storage again: the first to run frees it, the rest find nothing

    def _resized(self, st: torch.UntypedStorage) -> None:
        """A storage resized in place (FSDP2 frees and re-allocates its unsharded parameters so): a free, then
        an allocation of the new size, as the allocator sees it."""
        self._free(id(st))
        if st.nbytes() > 0:
            self._track(st)

    def __enter__(self) -> LiveMemory:
        # Storage resizes reach no dispatch mode; PyTorch's own MemTracker watches them the same way.
        self._resize = resize = torch.UntypedStorage.resize_

        def resize_(st, size):
            out = resize(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def reset_peak(self) -> None:
        self.peak = self.current

    def hold(self, tensors) -> None:
        """Count the storages of ``tensors``, made before the mode, as alive from now on, so that their frees are seen
        too (DDP rebuilds its gradient buckets in its second step: new ones made, the old ones freed)."""
        for t in tensors:
            for st in storages(t):
                self._track(st)

    def watch(self, tensors) -> None:
        """See the frees of ``tensors``' storages, made before the mode, without counting them as made now (an
        optimizer state that a step replaces, as GaLore's projections are: the old one's free lowers the count)."""
        current, peak = self.current, self.peak
        self.hold(tensors)
        self.current, self.peak = current, peak

    def rebase(self) -> None:
        """Count from here: what is alive now is the base (its frees still seen), the peak as high as the base."""
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _DEVICE and type(args[0]) is FakeTensor and not args[0].fake_mode.in_kernel_invocation:
            # PyTorch's C++ asks a fake tensor's device on most ops (24,000 times in an 8B step): answered here as the
            # fake mode's own prim.device handler answers, without the round trip through the mode (an 8B replay: 8.2
            # -> 7.7 s, three interleaved runs each).
            return args[0].fake_device
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _WAIT:
            # Waiting on a functional collective (DTensor's: tensor parallelism's gathers) hands back its input, as the
            # real kernel does; a fake mode's kernel makes a new tensor, a second copy of the buffer for a moment.
            return args[0]
        if func is _DEVICE or (getattr(func, "is_view", False) and func is not _LIFT):
            return out  # a tensor's device (asked for on most fake ops), or a view: nothing allocated, skipped for speed
        # Views and in-place results share an input's storage: nothing new was allocated
        # (this is what keeps views of parameters, such as a weight's transpose, out of the count).
        # lift_fresh hands back a constant made outside any op (torch.tensor(0.0)): on real tensors its input, on fake
        # ones a new tensor. Counted as made here either way, so that a real step and its fake replay count alike.
        inputs = set() if func is _LIFT else {id(st) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                                              for st in storages(t)}
        self.op = func
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                for st in storages(t):
                    if id(st) not in inputs:
                        self._track(st)
        return out


class SavedTensors:
    """Unique storages autograd saves for backward, the model's parameters and buffers excluded."""

    def __init__(self, model: nn.Module | None = None) -> None:
        # Storages by identity (``_cdata``): fake storages have no data pointer.
        held = [*model.parameters(), *model.buffers()] if model is not None else []
        self._exclude = {p.untyped_storage()._cdata for p in held}
        self.storages: dict[tuple, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._exclude and st.nbytes() > 0:
            self.storages.setdefault(key, st.nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> SavedTensors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
