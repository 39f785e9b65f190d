"""A model of PyTorch's CUDA caching allocator, fed with the allocations and frees of a (fake) step.

``max_memory_allocated`` counts the blocks the allocator hands out, and ``max_memory_reserved`` the
segments it took from the driver; both depend on the order of requests. This replays that order
through the native allocator's default rules (one stream, no ``PYTORCH_CUDA_ALLOC_CONF``):

- a request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the
  large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to
  2 MiB otherwise;
- the smallest free block of the pool that is large enough is taken (best fit), and split when what
  remains is at least 512 bytes (small pool) or over 1 MiB (large pool); otherwise the whole block
  is handed out and counted as allocated;
- a freed block merges with free neighbours in its segment; segments are never returned (no
  ``empty_cache``, no out-of-memory retry).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fitgpt.memory.tracker import round_up

MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, 2**20, 2 * 2**20
MIN_LARGE_ALLOC, LARGE_BUFFER, ROUND_LARGE = 10 * 2**20, 20 * 2**20, 2 * 2**20


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None
    small: bool = True

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)


class CachingAllocatorModel:
    """``malloc(key, nbytes)`` / ``free(key)``; ``allocated``, ``reserved`` and their peaks, in bytes."""

    def __init__(self) -> None:
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}  # small? -> sorted keys
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._used: dict[int, _Block] = {}
        self._segments = 0
        self.heads: dict[int, _Block] = {}
        """Each segment's first block (offset 0; merges keep it): the segment walked in order, for a snapshot."""

    @staticmethod
    def round_size(nbytes: int) -> int:
        return max(MIN_BLOCK, round_up(nbytes, MIN_BLOCK))

    @staticmethod
    def segment_size(size: int) -> int:
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return round_up(size, ROUND_LARGE)

    def _add_free(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free[b.small], b.key())
        self._blocks[b.key()] = b

    def _remove_free(self, b: _Block) -> None:
        keys = self._free[b.small]
        del keys[bisect.bisect_left(keys, b.key())]
        del self._blocks[b.key()]

    def malloc(self, key: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        size = self.round_size(nbytes)
        small = size <= SMALL_SIZE
        keys = self._free[small]
        i = bisect.bisect_left(keys, (size, -1, -1))
        block = self._blocks[keys[i]] if i < len(keys) else self._more_memory(small, size)
        self._remove_free(block)
        remaining = block.size - size
        if remaining >= MIN_BLOCK if small else remaining > SMALL_SIZE:
            rest = _Block(block.segment, block.offset + size, remaining, prev=block, next=block.next, small=small)
            if block.next:
                block.next.prev = rest
            block.next, block.size = rest, size
            self._add_free(rest)
        block.free = False
        self._used[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def _more_memory(self, small: bool, size: int) -> _Block:
        """Nothing free fits ``size``: a new segment from the driver (cudaMalloc), as a free block."""
        seg = self.segment_size(size)
        self._segments += 1
        block = self.heads[self._segments] = _Block(self._segments, 0, seg, small=small)
        self._add_free(block)
        self.reserved += seg
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def block_of(self, key) -> _Block | None:
        """The block handed out for ``key`` (its segment, offset and size), while it is allocated."""
        return self._used.get(key)

    def free(self, key: int) -> None:
        block = self._used.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(neighbour)
                if neighbour is block.prev:  # merge into the earlier block
                    neighbour.size += block.size
                    neighbour.next = block.next
                    if block.next:
                        block.next.prev = neighbour
                    block = neighbour
                else:
                    block.size += neighbour.size
                    block.next = neighbour.next
                    if neighbour.next:
                        neighbour.next.prev = block
        self._add_free(block)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


SMALL_PAGE, LARGE_PAGE = 2 * 2**20, 20 * 2**20


class ExpandableAllocatorModel(CachingAllocatorModel):
    """CUDA's caching allocator under ``expandable_segments:True`` (PyTorch's Note [Expandable Segments]): each pool
    (small, large) is one segment that grows at its end by pages of physical memory mapped into reserved address
    space (2 MiB pages for the small pool, 20 MiB for the large). A request takes the best-fitting free block, split
    by the same rules; if none fits, the segment grows by as few pages as make its free tail (or new pages past its
    last block) large enough. Pages are never unmapped here (PyTorch unmaps them only on out-of-memory or
    ``empty_cache``). Not modelled: the per-stream segments (one stream here), and gaps left by an unmap."""

    expandable = True

    def _more_memory(self, small: bool, size: int) -> _Block:
        """Nothing free fits ``size``: pages mapped at the end of the pool's segment; returns the free block grown."""
        page = SMALL_PAGE if small else LARGE_PAGE
        seg = 1 if small else 2
        head = self.heads.get(seg)
        last = head
        while last is not None and last.next is not None:
            last = last.next
        have = last.size if last is not None and last.free else 0
        added = round_up(size - have, page)
        if last is not None and last.free:  # the free tail grows
            self._remove_free(last)
            last.size += added
            block = last
        else:  # new pages past the last block (or the pool's first)
            block = _Block(seg, last.offset + last.size if last else 0, added, prev=last, small=small)
            if last is None:
                self.heads[seg] = block
            else:
                last.next = block
        self._add_free(block)
        self.reserved += added
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block


def allocator_model(expandable_segments: bool = False) -> CachingAllocatorModel:
    """The model of CUDA's caching allocator a run uses: the default, or with expandable segments."""
    return ExpandableAllocatorModel() if expandable_segments else CachingAllocatorModel()


# The settings PyTorch's CUDA allocator reads (c10's AllocatorConfig and CUDAAllocatorConfig, torch 2.13), by the
# values each takes: it refuses any other key, and a flag spelled other than True/False.
_FLAGS = ("expandable_segments", "pinned_use_background_threads", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc",
          "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "graph_capture_record_stream_reuse",
          "pinned_free_catch_all", "throw_on_cudamalloc_oom")
_COUNTS = ("max_split_size_mb", "max_non_split_rounding_mb", "pinned_num_register_threads", "pinned_reserve_segment_size_mb")
_FRACTIONS = ("garbage_collection_threshold", "per_process_memory_fraction")
ALLOC_KEYS = frozenset(_FLAGS + _COUNTS + _FRACTIONS + ("roundup_power2_divisions", "backend"))


def _settings(conf: str) -> list[tuple[str, str]]:
    """(key, value) of each setting, split at the commas outside brackets (``roundup_power2_divisions:[256:1,>:8]``)."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(conf + ","):
        depth += c == "["
        depth -= c == "]"
        if c == "," and depth == 0:
            if conf[start:i].strip():
                key, _, value = conf[start:i].partition(":")
                items.append((key.strip(), value.strip()))
            start = i + 1
    return items


def _bad_value(key: str, value: str) -> str | None:
    """Why PyTorch would refuse ``value`` for ``key``, or None."""
    if key in _FLAGS and value not in ("True", "False"):
        return "True or False (spelled so)"
    if key in _COUNTS and not value.isdigit():
        return "a whole number"
    if key in _FRACTIONS:
        try:
            if not 0.0 < float(value) < 1.0:
                return "a fraction between 0 and 1"
        except ValueError:
            return "a fraction between 0 and 1"
    if key == "backend" and value not in ("native", "cudaMallocAsync"):
        return "native or cudaMallocAsync"
    if key == "roundup_power2_divisions" and not (value.isdigit() or (value.startswith("[") and value.endswith("]"))):
        return "a power of two, or a list such as [256:1,512:2,>:8]"
    return None


def expandable_from(conf: str | None = None, flag: str = "--alloc-conf") -> bool:
    """Whether allocator settings (``conf``, as PYTORCH_CUDA_ALLOC_CONF spells them; default: this environment's
    PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF) turn expandable segments on. Settings PyTorch's allocator would
    refuse (an unknown key, ``expandable_segments:true``) are refused here, naming ``flag`` or the variable."""
    import os

    from fitgpt.errors import UserError

    if conf is None:
        flag = next((v for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if os.environ.get(v)), "")
        conf = os.environ.get(flag, "") if flag else ""
    elif not conf.strip():
        raise UserError(f"{flag} is empty (an unset shell variable?): give settings such as expandable_segments:True, "
                        f"or drop {flag}")
    settings = _settings(conf)
    for key, value in settings:
        if key not in ALLOC_KEYS:
            raise UserError(f"{flag}: PyTorch's CUDA allocator has no setting {key!r} (it knows {', '.join(sorted(ALLOC_KEYS))})")
        if why := _bad_value(key, value):
            raise UserError(f"{flag}: {key}:{value} would be refused by PyTorch's allocator; {key} takes {why}")
    return dict(settings).get("expandable_segments") == "True"
