"""Memory snapshots in PyTorch's format: the dict ``torch.cuda.memory._snapshot()`` returns, which pytorch.org/memory_viz
and ``python -m torch.cuda._memory_viz trace_plot snap.pickle -o out.html`` draw.

``SnapshotTrace`` wraps a model of an allocator (``malloc(key, nbytes)`` / ``free(key)``) and records what it does as
the snapshot's ``device_traces`` do: a segment reserved (``segment_alloc``), a block handed out (``alloc``), a block
taken back (``free_requested`` then ``free_completed``), a segment released (``segment_free``), each block with frames
saying what asked for it (the step's phase and the op). ``snapshot()`` adds the segments as they end, block by block.
Fed by the planner's fake step it is a predicted snapshot, for a card this machine lacks; fed by the live-tensor
tracker of a real step (``LiveMemory`` on any device), a measured one in the same format, event for event alike.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

from fitgpt.memory.allocator import _Block
from fitgpt.memory.tracker import round_up

BASE, ALIGN = 0x7F0000000000, 2 * 2**20
"""Where the snapshot's first segment starts, and each next one past the last, rounded up (made-up addresses: only
their order and the offsets within a segment mean anything)."""


class ExactAllocator:
    """No cache: each allocation a segment of its own size, released when freed (the host's malloc, as a snapshot
    shows it). The interface of ``CachingAllocatorModel``."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.heads: dict[int, _Block] = {}
        self._used: dict[object, _Block] = {}
        self._segments = 0

    def malloc(self, key, nbytes: int) -> None:
        if nbytes == 0 or key in self._used:
            return
        self._segments += 1
        self._used[key] = self.heads[self._segments] = _Block(self._segments, 0, nbytes, free=False, small=False)
        self.allocated += nbytes
        self.reserved += nbytes
        self.peak_allocated, self.peak_reserved = max(self.peak_allocated, self.allocated), max(self.peak_reserved, self.reserved)

    def free(self, key) -> None:
        block = self._used.pop(key, None)
        if block is not None:
            del self.heads[block.segment]
            self.allocated -= block.size
            self.reserved -= block.size

    def block_of(self, key) -> _Block | None:
        return self._used.get(key)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def _event(action: str, addr: int, size: int, frames: list[dict]) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames}


def _segment_size(head: _Block) -> int:
    size, b = 0, head
    while b is not None:
        size, b = size + b.size, b.next
    return size


class SnapshotTrace:
    """``alloc`` (an allocator model) with every segment and block it makes recorded; ``frames()`` names what asks."""

    def __init__(self, alloc, frames: Callable[[], list[dict]] = lambda: []) -> None:
        self.alloc, self.frames = alloc, frames
        self.events: list[dict] = []
        self._address: dict[int, tuple[int, int]] = {}  # segment -> (address, size)
        self._next = BASE
        self._info: dict = {}  # key -> (requested bytes, frames) of each block handed out
        self._expandable = getattr(alloc, "expandable", False)

    def __getattr__(self, name: str):  # peaks, reset_peaks: the allocator's own
        return getattr(self.alloc, name)

    def malloc(self, key, nbytes: int) -> None:
        before = {seg: _segment_size(head) for seg, head in self.alloc.heads.items()} if self._expandable else set(self.alloc.heads)
        self.alloc.malloc(key, nbytes)
        block = self.alloc.block_of(key)
        if block is None or key in self._info:
            return
        for seg in sorted(set(self.alloc.heads) - set(before)):
            size = _segment_size(self.alloc.heads[seg])
            self._address[seg] = (self._next, size)
            self.events.append(_event("segment_alloc", self._next, size, []))
            # An expandable segment grows in place: its address space is reserved far beyond what is mapped.
            self._next += 2**40 if self._expandable else round_up(size, ALIGN)
        for seg in before if self._expandable else ():
            grown = _segment_size(self.alloc.heads[seg]) - before[seg]
            if grown:  # pages mapped at its end, as PyTorch's trace records them
                address, size = self._address[seg]
                self.events.append(_event("segment_map", address + size, grown, []))
                self._address[seg] = (address, size + grown)
        frames = self.frames()
        self._info[key] = (nbytes, frames)
        self.events.append(_event("alloc", self._address[block.segment][0] + block.offset, block.size, frames))

    def free(self, key) -> None:
        block = self.alloc.block_of(key)
        if block is None or key not in self._info:
            self.alloc.free(key)
            return
        addr, size = self._address[block.segment][0] + block.offset, block.size
        del self._info[key]
        frames = self.frames()  # where it is freed, as PyTorch's trace records a free
        before = set(self.alloc.heads)
        self.alloc.free(key)
        self.events += [_event("free_requested", addr, size, frames), _event("free_completed", addr, size, frames)]
        for seg in sorted(before - set(self.alloc.heads)):
            self.events.append(_event("segment_free", *self._address.pop(seg), []))

    def snapshot(self, settings: dict | None = None) -> dict:
        """The snapshot now: the segments held, block by block, and every event so far (device 0)."""
        keys = {id(b): k for k, b in self.alloc._used.items()}
        segments = []
        for seg, head in sorted(self.alloc.heads.items()):
            address, _ = self._address[seg]
            blocks, b = [], head
            while b is not None:
                requested, frames = self._info[keys[id(b)]] if not b.free and id(b) in keys else (0, [])
                blocks.append({"address": address + b.offset, "size": b.size, "requested_size": requested,
                               "state": "inactive" if b.free else "active_allocated", "frames": frames})
                b = b.next
            active = sum(x["size"] for x in blocks if x["state"] == "active_allocated")
            segments.append({"device": 0, "address": address, "total_size": sum(x["size"] for x in blocks),
                             "allocated_size": active, "active_size": active,
                             "requested_size": sum(x["requested_size"] for x in blocks), "stream": 0,
                             "segment_type": "small" if head.small else "large", "segment_pool_id": (0, 0),
                             "is_expandable": self._expandable, "frames": [], "blocks": blocks})
        return {"segments": segments, "device_traces": [list(self.events)], "allocator_settings": settings or {}}


class Where:
    """What is allocating now, as a snapshot's frames: the step's phase (``mark`` takes `block_marks`' names and
    the step's own) and the op the live-tensor tracker is running (``live.op``)."""

    def __init__(self, live=None, n_blocks: int = 0) -> None:
        self.live, self.n_blocks, self.phase, self.step = live, n_blocks, "before the step", 1

    def mark(self, name: str) -> None:
        kind, _, i = name.rpartition("_")
        step = f"step {self.step}: "
        if kind == "fwd_pre":
            self.phase = f"{step}forward, block {i}"
        elif kind == "fwd_post":
            self.phase = f"{step}forward, head and loss" if int(i) == self.n_blocks - 1 else f"{step}forward, after block {i}"
        elif kind == "bwd_out":
            self.phase = f"{step}backward, block {i}"
        elif kind == "bwd_in":
            self.phase = f"{step}backward, embedding"
        else:
            self.phase = name

    def frames(self) -> list[dict]:
        op = getattr(self.live, "op", None)
        return [{"filename": self.phase, "line": 0, "name": str(op) if op is not None else "(tensor made outside an op)"}]


def write_snapshot(snapshot: dict, path: str | Path) -> Path:
    """The snapshot pickled, as ``torch.cuda.memory._dump_snapshot`` writes it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path


class MeasuredSnapshot:
    """The memory of the steps run inside it, as a snapshot: on CUDA the allocator's own history
    (``torch.cuda.memory._record_memory_history``); on any other device the live-tensor tracker through
    ``ExactAllocator``, the weights, gradients and optimizer state held on entry counted first, each block named by
    phase and op as the planner's predicted snapshot names it. ``with MeasuredSnapshot(model, optimizer) as rec: ...``,
    then ``rec.snapshot``; ``rec.next_step()`` between steps numbers them."""

    def __init__(self, model, optimizer=None, device=None) -> None:
        from fitgpt.activation_checkpoint.apply import find_blocks

        self.model, self.optimizer = model, optimizer
        self.device = device or next(model.parameters()).device
        self.blocks = find_blocks(model)[1]
        self.snapshot: dict | None = None

    def __enter__(self) -> MeasuredSnapshot:
        import contextlib

        from fitgpt.memory.timeline import _grads, block_marks, model_tensors, optimizer_state_tensors
        from fitgpt.memory.tracker import LiveMemory

        if self.device.type == "cuda":
            import torch

            torch.cuda.memory._record_memory_history(max_entries=1_000_000, device=self.device)
            return self
        self.where = Where(n_blocks=len(self.blocks))
        self.trace = SnapshotTrace(ExactAllocator(), self.where.frames)
        self._stack = contextlib.ExitStack()
        self.live = self._stack.enter_context(LiveMemory(allocator=self.trace))
        self.where.live = self.live
        for phase, tensors in (("weights", model_tensors(self.model)), ("gradients held", _grads(self.model)),
                               ("optimizer state", optimizer_state_tensors(self.optimizer))):
            self.where.mark(phase)
            self.live.hold(tensors)
        self._stack.enter_context(block_marks(self.blocks, self.where.mark))
        if hasattr(self.optimizer, "register_step_pre_hook"):  # the optimizer's own step, named as the planner names it
            hook = self.optimizer.register_step_pre_hook(lambda *_: self.where.mark(f"step {self.where.step}: optimizer step"))
            self._stack.callback(hook.remove)
        self.where.mark("step 1: forward, embedding")
        return self

    def batch(self, make: Callable[[], list]) -> list:
        """The data loader's micro-batches, ``make()``, counted as the plan's step counts its own: the ids and targets,
        a tensor each, made at the step's start; the loader's own temporaries are no part of the step. (CUDA's own
        history records every allocation as it is.)"""
        if self.device.type == "cuda":
            return make()
        with self.outside():
            batches = make()
        self.live.hold([t for b in batches for t in b])
        return batches

    def outside(self):
        """A context whose tensors are not recorded (what the trainer does between steps)."""
        import contextlib

        if self.device.type == "cuda":
            return contextlib.nullcontext()
        from torch.utils._python_dispatch import _disable_current_modes

        return _disable_current_modes()

    def next_step(self) -> None:
        if self.device.type != "cuda":
            self.where.step += 1
            self.where.mark(f"step {self.where.step}: forward, embedding")

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            import torch

            self.snapshot = torch.cuda.memory._snapshot(self.device)
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
            return
        self._stack.__exit__(*exc)
        self.snapshot = self.trace.snapshot({"host": "one segment a tensor"})


def step_events(snapshot: dict) -> list[tuple[str, int, str, str]]:
    """(action, bytes, phase, op) of a snapshot's allocations and frees in its steps (phases named ``step N: ...``),
    the setup before them left out: what a predicted and a measured snapshot are compared on."""
    out = []
    for e in snapshot["device_traces"][0]:
        frame = (e.get("frames") or [{}])[0]
        if e["action"] in ("alloc", "free_completed") and str(frame.get("filename", "")).startswith("step "):
            out.append((e["action"], e["size"], frame["filename"], frame.get("name", "")))
    return out


def first_difference(predicted: dict, measured: dict) -> str | None:
    """Where two snapshots' steps part, in words (the event, its phase and op, the bytes each has); None if alike."""
    a, b = step_events(predicted), step_events(measured)
    for i, (p, m) in enumerate(zip(a, b)):
        if p[:2] != m[:2]:
            return (f"event {i} ({p[2]}): predicted {p[0]} of {p[1]:,} bytes in {p[3]}, measured {m[0]} of {m[1]:,} bytes "
                    f"in {m[3]}")
    if len(a) != len(b):
        return f"after {min(len(a), len(b))} alike events: predicted {len(a)} events, measured {len(b)}"
    return None


def read_snapshot(path: str | Path) -> dict:
    """A snapshot written by ``write_snapshot`` or ``torch.cuda.memory._dump_snapshot``; one line if it is not one.
    It is plain data (dicts, lists, strings, numbers), so it is unpickled allowing nothing else: a file that would
    build any object or call any function is refused, naming what it needs, and none of its code runs."""
    from fitgpt import safe_pickle
    from fitgpt.errors import UserError

    try:
        with open(path, "rb") as f:
            snap = safe_pickle.load(f)
    except safe_pickle.UnsafePickleError as e:
        raise UserError(f"{path} is not a memory snapshot: {e}; refusing to load it") from None
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as e:
        raise UserError(f"{path} is not a memory snapshot ({e})") from None
    if not isinstance(snap, dict) or not isinstance(snap.get("device_traces"), list) or not snap["device_traces"]:
        raise UserError(f"{path} is not a memory snapshot with a trace (record one with fitgpt train --memory-snapshot N)")
    for i, e in enumerate(snap["device_traces"][0] if isinstance(snap["device_traces"][0], list) else [None]):
        if not _event_ok(e):
            raise UserError(f"{path} is not a memory snapshot: event {i} of its trace is malformed ({str(e)[:80]})")
    return snap


def _event_ok(e: object) -> bool:
    """What ``step_events`` and the pictures read of a trace event: an action, a size, and frames of dicts."""
    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(e, dict) or not isinstance(e.get("action"), str) or not whole(e.get("size")):
        return False
    frames = e.get("frames", [])
    return ((whole(e.get("addr")) or not e["action"].startswith(("alloc", "free")))
            and isinstance(frames, list) and all(isinstance(f, dict) for f in frames))
