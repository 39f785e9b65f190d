"""Marks in a pipeline rank's recorded step (`fitgpt.estimate.pipeline_compose`): where each action (a micro-batch's
forward or backward of a stage), each block and the schedule's step end begin, put among the step's allocations and
frees by hooks and wrappers that allocate nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fitgpt.activation_checkpoint import ActivationCheckpointWrapper
from fitgpt.memory.tracker import round_up, storages


@dataclass(frozen=True)
class Mark:
    """A place in a recorded step: an action begins ("F", "B": ``stage``, micro-batch ``index``), a block begins
    ("b": ``stage``, the block's place ``index`` in it, forward or backward) or the schedule's step ends ("end")."""

    kind: str
    stage: int = -1
    index: int = -1


class Recorder:
    """An allocator model for ``LiveMemory``: each allocation (+bytes) and free (-bytes), rounded as the probe rounds
    them, in order, with the marks put among them; and for each free, the action its storage was made in."""

    def __init__(self, round_to: int) -> None:
        self.round_to, self.tokens, self.births = round_to, [], {}
        self._sizes, self._action, self._at = {}, None, {}

    def malloc(self, key: int, nbytes: int) -> None:
        n = round_up(nbytes, self.round_to)
        self._sizes[key] = (n, self._action)
        if n:
            self._at[key] = len(self.tokens)
            self.tokens.append(n)

    def unmade(self, tensors) -> None:
        """Count ``tensors``, made during the recording and alive still, as made before it (nothing in its place)."""
        for t in tensors:
            for st in storages(t):
                if (i := self._at.get(id(st))) is not None and id(st) in self._sizes:
                    self.tokens[i] = 0
                    del self._sizes[id(st)]

    def free(self, key: int) -> None:
        n, born = self._sizes.pop(key, (0, None))
        if n:
            self.births[len(self.tokens)] = born
            self.tokens.append(-n)

    def mark(self, mark: Mark) -> None:
        if mark.kind in ("F", "B"):
            self._action = (mark.kind, mark.stage, mark.index)
        self.tokens.append(mark)

    def clear(self) -> None:
        self.tokens.clear()
        self.births.clear()


@contextlib.contextmanager
def marked(pipe, rec: Recorder) -> Iterator[None]:
    """``pipe``'s actions, blocks and step end marked in ``rec`` while the context lasts. Hooks and wrappers only: they
    allocate nothing."""
    handles, patched = [], []
    for stage, wrapped in zip(pipe.stages, pipe.wrapped):
        s = wrapped.stage_index
        for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
            patched.append((wrapped, name))
            setattr(wrapped, name, _announced(getattr(wrapped, name), rec, kind, s))
        for j, i in enumerate(stage.blocks):
            # On the module FSDP shards, first among its hooks (prepend): FSDP's gathering of a block's weights, forward
            # and backward, falls within the block's own marks, not its neighbour's.
            block = _inner(stage.attn_blocks[i])
            handles.append(block.register_forward_pre_hook(lambda m, a, _s=s, _j=j: rec.mark(Mark("b", _s, _j)),
                                                           prepend=True))
            handles.append(block.register_forward_hook(_backward_marked(rec, s, j), prepend=True))
            group = block._get_fsdp_state()._fsdp_param_group if hasattr(block, "_get_fsdp_state") else None
            if group is not None:  # FSDP's reduction of the block's gradients, which the last backward may leave to its end
                patched.append((group, "post_backward"))
                group.post_backward = _announced(group.post_backward, rec, "b", s, j)
        for module, j in _sharded(stage):
            patched.append((module, "unshard"))
            module.unshard = _unshard_marked(module.unshard, rec, s, j)
    step = pipe.train_batch

    def train_batch(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = step(x, y)
        rec.mark(Mark("end"))
        return loss

    pipe.train_batch = train_batch
    try:
        yield
    finally:
        del pipe.train_batch
        for h in handles:
            h.remove()
        for wrapped, name in patched:
            delattr(wrapped, name)  # the class's method again


def _announced(run, rec: Recorder, kind: str, stage: int, index: int | None = None):
    """``run`` marked as it begins: with ``index``, or else the micro-batch it is given first."""
    def announced(*args, **kwargs):
        at = index if index is not None else args[0] if args else next(iter(kwargs.values()))
        rec.mark(Mark(kind, stage, at))
        return run(*args, **kwargs)
    return announced


def _sharded(stage) -> Iterator[tuple[object, int]]:
    """The stage's modules FSDP shards, each with its block's place in the stage (-1: the stage itself)."""
    places = {id(_inner(stage.attn_blocks[i])): j for j, i in enumerate(stage.blocks)}
    for module in stage.modules():
        if hasattr(module, "unshard") and hasattr(module, "_get_fsdp_state"):
            yield module, places.get(id(module), -1)


def _inner(block):
    """The block itself, inside its checkpoint wrapper if it has one (what FSDP shards and the hooks go on)."""
    return block.inner if isinstance(block, ActivationCheckpointWrapper) else block


def _unshard_marked(unshard, rec: Recorder, stage: int, j: int):
    """A module's ``unshard``, as the interleaved schedule calls it to gather a stage's weights ahead (and waits on it
    before the stage's first action), marked as its block's, when it starts and when it is waited on."""
    def marked_unshard(*args, **kwargs):
        rec.mark(Mark("b", stage, j))
        handle = unshard(*args, **kwargs)
        return _MarkedWait(handle, rec, Mark("b", stage, j)) if handle is not None else None
    return marked_unshard


class _MarkedWait:
    def __init__(self, handle, rec: Recorder, mark: Mark) -> None:
        self.handle, self.rec, self.mark = handle, rec, mark

    def wait(self) -> None:
        self.rec.mark(self.mark)
        self.handle.wait()


def _backward_marked(rec: Recorder, stage: int, j: int):
    def hook(module, args, out) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:  # its gradient arriving: the block's backward begins
            out.register_hook(lambda grad: rec.mark(Mark("b", stage, j)))
    return hook
