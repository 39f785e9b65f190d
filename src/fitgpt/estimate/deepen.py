"""A deep model's step as the allocator sees it, from a shallow model's: its allocations and frees, block by block.

A step's allocations and frees, in order, are what the caching-allocator replay needs. At full depth (32 or 80
blocks) they take a fake step of the whole model, seconds each, and the planner replays two or three plans. But a
middle block allocates and frees as its neighbours do: the same sizes, in the same order, freeing what the blocks
at the same distance made (FSDP lets a gather go two blocks on). So the step of a shallow model is recorded cut at
every block boundary (`Recording`), and in each run of blocks alike one middle block's segments are repeated to the
full depth (`deepen`).

Keys name what a full-depth step allocates: ``("b", phase, micro-batch, block, n)`` the n-th allocation of a block's
forward or backward segment, ``("g", token)`` one outside any block (embedding, head, loss, between steps), made once
whatever the depth. A free names the allocation it frees by its distance in blocks and its place in that block's
segment. Where a free names a block that the full depth takes from another shallow segment than the one it was made
in, the two segments must be alike (the same sizes and frees); otherwise, or where a free would find nothing alive,
`deepen` raises `NotAlike`, and the caller replays the full depth instead.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator

Event = tuple[object, int | None]
"""(key, bytes) for an allocation, (key, None) for a free."""


class NotAlike(Exception):
    """The shallow step's middle blocks do not repeat: it cannot be deepened exactly."""


class Recording:
    """Allocations and frees (an allocator's ``malloc(key, nbytes)`` and ``free(key)``, keys reused once freed), each
    given a token, cut into segments at ``mark(name)``: ``block_marks``'s names, and ``update`` / ``update_end``
    around the optimizer's update."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.segments: list[tuple[tuple, list[tuple[int, int | None]]]] = [(("g", 0), [])]
        self.born: dict[int, tuple[tuple, int]] = {}
        """token -> (the segment it was allocated in, its place among that segment's allocations)."""
        self.live: dict[object, int] = {}
        """key -> token, while allocated."""
        self._micro = 0
        self._place = 0  # allocations so far in the current segment

    def malloc(self, key, nbytes: int) -> None:
        if nbytes == 0:
            return
        label, events = self.segments[-1]
        token = len(self.born)
        self.born[token] = (label, self._place)
        self._place += 1
        self.live[key] = token
        events.append((token, nbytes))

    def free(self, key) -> None:
        token = self.live.pop(key, None)
        if token is not None:
            self.segments[-1][1].append((token, None))

    def mark(self, name: str) -> None:
        """A segment begins."""
        kind, _, i = name.rpartition("_")
        if name == "fwd_pre_0":
            self._micro += 1
            self._begin(("fwd", self._micro, 0))
        elif kind == "fwd_post":
            last = int(i) + 1 == self.n_blocks
            self._begin(("g", len(self.segments)) if last else ("fwd", self._micro, int(i) + 1))
        elif kind == "bwd_out":
            self._begin(("bwd", self._micro, int(i)))
        elif name in ("bwd_in_0", "update_end"):
            self._begin(("g", len(self.segments)))
        elif name == "update":
            self._begin(("update",))
        # fwd_pre_i (i > 0): a block's forward runs from the previous block's end, as the profile cuts it

    def _begin(self, label: tuple) -> None:
        self.segments.append((label, []))
        self._place = 0


def deepen(rec: Recording, copies: list[int], update: list[Event], update_out: list[tuple[int, object]]) -> list[Event]:
    """The allocations and frees of ``rec``'s step with shallow block i run ``copies[i]`` times over (a middle block of a
    run of alike blocks; 1 for the others), the blocks after renumbered. ``update``: the optimizer update's events at
    full depth (keys its own), put in place of ``rec``'s; ``update_out``: (token in ``rec``, key in ``update``) of what
    the update returns, freed later."""
    return list(_Deepened(rec, copies, update, dict(update_out)).events())


class _Deepened:
    def __init__(self, rec: Recording, copies: list[int], update: list[Event], update_out: dict[int, object]):
        self.rec, self.copies, self.update, self.update_out = rec, copies, update, update_out
        self.first = [sum(copies[:i]) for i in range(len(copies))]
        """The full-depth block of each shallow block (its first copy)."""
        self.segments = {label: events for label, events in rec.segments}
        self._canon: dict[tuple, tuple] = {}

    def blocks(self, b: int) -> range:
        """The full-depth blocks shallow block ``b`` runs as."""
        return range(self.first[b], self.first[b] + self.copies[b])

    def shallow_of(self, block: int) -> int:
        """The shallow block whose segments full-depth block ``block`` repeats (-1: none)."""
        return bisect.bisect_right(self.first, block) - 1 if 0 <= block < self.first[-1] + self.copies[-1] else -1

    def events(self) -> Iterator[Event]:
        live: set = set()
        for label, events in self.rec.segments:
            for key, nbytes in self._segment(label, events):
                if nbytes is None:
                    if key not in live:
                        raise NotAlike(f"{label} frees {key}, which is not allocated then")
                    live.discard(key)
                else:
                    live.add(key)
                yield key, nbytes

    def _segment(self, label: tuple, events) -> Iterable[Event]:
        if label == ("update",):
            return self.update
        if label[0] == "g":
            return self._outside(events)
        blocks = self.blocks(label[2])
        return (e for block in (reversed(blocks) if label[0] == "bwd" else blocks) for e in self._block(label, events, block))

    def _block(self, label: tuple, events, block: int) -> Iterator[Event]:
        """Block ``label``'s segment as full-depth block ``block`` runs it."""
        place = 0
        for token, nbytes in events:
            if nbytes is not None:
                yield ("b", label[0], label[1], block, place), nbytes
                place += 1
                continue
            born, at = self.rec.born[token]
            if born[0] not in ("fwd", "bwd"):
                if self.copies[label[2]] > 1:
                    raise NotAlike(f"the repeated segment {label} frees {born}'s allocation")
                yield self._made_outside(token, born), None
                continue
            made = block + born[2] - label[2]  # the same distance in blocks as in the shallow step
            source = (born[0], born[1], self.shallow_of(made))
            if source != born and self._canonical(source) != self._canonical(born):
                raise NotAlike(f"{label} frees from {born}, which full-depth block {made} takes from {source}: unlike")
            yield ("b", born[0], born[1], made, at), None

    def _outside(self, events) -> Iterator[Event]:
        """A segment outside the blocks, once. Where it frees what a repeated block made (the gradients, block by
        block), the run of those frees is repeated for every copy, in order."""
        run: list[tuple[tuple, int]] = []  # (segment, place) of one repeated block's allocations freed in a row
        for token, nbytes in events:
            born, at = self.rec.born[token]
            repeated = nbytes is None and born[0] in ("fwd", "bwd") and self.copies[born[2]] > 1
            if repeated and (not run or run[0][0][2] == born[2]):
                run.append((born, at))
                continue
            yield from self._run(run)
            run = [(born, at)] if repeated else []
            if repeated:
                continue
            if nbytes is not None:
                yield ("g", token), nbytes
            elif born[0] not in ("fwd", "bwd"):
                yield self._made_outside(token, born), None
            else:
                yield ("b", born[0], born[1], self.first[born[2]], at), None
        yield from self._run(run)

    def _run(self, run: list[tuple[tuple, int]]) -> Iterator[Event]:
        for block in self.blocks(run[0][0][2]) if run else ():
            yield from ((("b", born[0], born[1], block, at), None) for born, at in run)

    def _made_outside(self, token: int, born: tuple) -> object:
        if born == ("update",):
            if token not in self.update_out:
                raise NotAlike("the step frees what the shallow update made and the full-depth one did not return")
            return self.update_out[token]
        return ("g", token)

    def _canonical(self, label: tuple) -> tuple:
        """A block segment as its neighbours would repeat it: sizes, and each free by distance and place."""
        if label not in self._canon:
            out = []
            for token, nbytes in self.segments.get(label, ()):
                born, at = self.rec.born[token] if nbytes is None else (None, None)
                if nbytes is not None:
                    out.append(nbytes)
                elif born[0] in ("fwd", "bwd"):
                    out.append((born[0], born[1], born[2] - label[2], at))
                else:
                    out.append(("outside", token))
            self._canon[label] = tuple(out)
        return self._canon[label]


# ---- a step's events, replayed ----------------------------------------------------------------------------------


def feed(alloc, events: list[Event]) -> None:
    for key, nbytes in events:
        if nbytes is None:
            alloc.free(key)
        else:
            alloc.malloc(key, nbytes)


class Recorder:
    """Passes a step's allocations and frees on to the allocator model, in order, and keeps them."""

    def __init__(self, alloc) -> None:
        self.alloc, self.events = alloc, []

    def malloc(self, key, nbytes: int) -> None:
        self.events.append((key, nbytes))
        self.alloc.malloc(key, nbytes)

    def free(self, key) -> None:
        self.events.append((key, None))
        self.alloc.free(key)


def repeated(events: list[Event], state: set) -> list[Event] | None:
    """The next step's allocations and frees: ``events`` (a first step's) less the optimizer state they created
    (``state``: its keys), where nothing else the step made outlives it and it freed nothing made before it; None
    otherwise.

    The second step then runs the same ops on tensors of the same sizes, in the same order: it is the first without
    the state's creation (tested equal, allocation by allocation). Skipping its fake ops halves the replay's time."""
    live: dict = {}  # key -> the index of its allocation (a freed storage's id may be taken again)
    for i, (key, nbytes) in enumerate(events):
        if nbytes is not None:
            live[key] = i
        elif live.pop(key, None) is None:
            return None  # freed what an earlier step made (DDP rebuilding its buckets, say)
    if not live.keys() <= state:
        return None  # gradients kept between steps, say: the next step does not allocate them again
    kept = set(live.values())
    return [(("again", key), nbytes) for i, (key, nbytes) in enumerate(events) if i not in kept]
