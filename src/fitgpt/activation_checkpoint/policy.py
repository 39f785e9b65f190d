"""Checkpointing policies: a spec string parsed into one small object, resolved into regions.

Grammar: terms joined by ``+``.

    none                 no checkpointing (a real choice)
    block                every block is its own region (the seed's Method 1)
    group:K              each run of K consecutive blocks is one region (Method 2, done right)
    every:K              only blocks 0, K, 2K, ... are checkpointed (partial recompute)
    blocks:0,3,5         an explicit subset (what `fitgpt plan` emits)
    sqrt                 round(sqrt(N)) groups of consecutive blocks (Chen et al. 2016)
    selective[:i,j]      op-level: keep attention and widening matmul outputs, recompute the rest
    pointwise[:i,j]      op-level: keep every matmul and attention output, recompute only the
                         pointwise ops (norms, GELU, dropout, residual adds): no matmul is run twice
    torchtitan[:i,j]     op-level, torchtitan's rule: keep attention outputs and every second mm, recompute the rest
    offload[:i,j]        the blocks' saved tensors (or, under block recompute, their boundary) go to host memory
    chunked-loss[:ROWS]  head + cross-entropy in chunks of ROWS tokens, never holding all logits
    fused-loss[:ROWS]    head + cross-entropy in chunks, their gradients computed in the forward: no logits held,
                         nothing recomputed (Liger-Kernel's fused linear cross-entropy, in PyTorch ops)

At most one recompute selector covers a block; ``offload`` and one loss term compose with any.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fitgpt.errors import UserError

RECOMPUTE_NONE, RECOMPUTE_BLOCK, RECOMPUTE_SELECTIVE, RECOMPUTE_POINTWISE = "none", "block", "selective", "pointwise"
RECOMPUTE_TORCHTITAN = "torchtitan"
OP_LEVEL = (RECOMPUTE_SELECTIVE, RECOMPUTE_POINTWISE, RECOMPUTE_TORCHTITAN)
"""Recompute options chosen op by op (a save list), each block its own region."""
DEFAULT_LOSS_CHUNK_ROWS = 1024


@dataclass(frozen=True)
class Selector:
    """Which blocks a term covers: kind is all, every, blocks, group or sqrt."""

    kind: str
    k: int = 0
    ids: tuple[int, ...] = ()

    def block_ids(self, n: int) -> list[int]:
        if self.kind == "every":
            return list(range(0, n, self.k))
        if self.kind == "blocks":
            bad = [i for i in self.ids if i >= n]
            if bad:
                raise UserError(f"block ids {bad} are out of range for a model with {n} blocks (ids go 0..{n - 1})")
            return sorted(self.ids)
        return list(range(n))  # all, group, sqrt

    def group_size(self, n: int) -> int:
        if self.kind == "group":
            return self.k
        if self.kind == "sqrt":
            return math.ceil(n / max(1, round(math.sqrt(n))))
        return 1


@dataclass(frozen=True)
class Region:
    """Blocks [start, stop) run as one checkpoint region with one recompute option."""

    start: int
    stop: int
    recompute: str
    offload: bool = False


@dataclass(frozen=True)
class Policy:
    spec: str
    block: Selector | None = None
    selective: Selector | None = None
    pointwise: Selector | None = None
    torchtitan: Selector | None = None
    offload: Selector | None = None
    loss_chunk_rows: int | None = None
    loss_fused_rows: int | None = None

    @property
    def is_none(self) -> bool:
        return all(x is None for x in (self.block, self.selective, self.pointwise, self.torchtitan, self.offload,
                                       self.loss_chunk_rows, self.loss_fused_rows))

    @property
    def recompute_options(self) -> tuple[str, ...]:
        """The recompute options the policy names (block for any whole-block selector)."""
        named = ((self.block, RECOMPUTE_BLOCK), (self.selective, RECOMPUTE_SELECTIVE), (self.pointwise, RECOMPUTE_POINTWISE),
                 (self.torchtitan, RECOMPUTE_TORCHTITAN))
        return tuple(option for sel, option in named if sel is not None)

    def regions(self, n_blocks: int) -> list[Region]:
        """One region per block (or per group), in order, covering all n_blocks blocks."""
        recompute = [RECOMPUTE_NONE] * n_blocks
        for sel, option in ((self.block, RECOMPUTE_BLOCK), (self.selective, RECOMPUTE_SELECTIVE),
                            (self.pointwise, RECOMPUTE_POINTWISE), (self.torchtitan, RECOMPUTE_TORCHTITAN)):
            if sel is not None:
                for i in sel.block_ids(n_blocks):
                    if recompute[i] != RECOMPUTE_NONE:
                        raise UserError(f"block {i} is covered by two recompute terms in {self.spec!r}; give each block one")
                    recompute[i] = option
        offload = set(self.offload.block_ids(n_blocks)) if self.offload else set()
        k = self.block.group_size(n_blocks) if self.block else 1
        if k > n_blocks:
            raise UserError(f"group size {k} is larger than the model's {n_blocks} blocks; use group:{n_blocks} or less")
        if k > 1:
            regions = []
            for s in range(0, n_blocks, k):
                stop = min(s + k, n_blocks)
                if len({i in offload for i in range(s, stop)}) > 1:
                    raise UserError(f"offload must cover whole groups in {self.spec!r}: blocks {s}..{stop - 1} are one region")
                regions.append(Region(s, stop, RECOMPUTE_BLOCK, s in offload))
            return regions
        return [Region(i, i + 1, recompute[i], i in offload) for i in range(n_blocks)]

    def of_blocks(self, ids: list[int], n_blocks: int) -> str | None:
        """The spec of this policy for a model of the blocks ``ids`` (in order) of an ``n_blocks`` one, each with its
        option here, the loss as here; None where blocks run together as one region (a group)."""
        regions = self.regions(n_blocks)
        if len(regions) != n_blocks:
            return None
        terms = []
        for option in (RECOMPUTE_BLOCK, *OP_LEVEL, "offload"):
            kept = [str(j) for j, i in enumerate(ids) if (regions[i].offload if option == "offload" else regions[i].recompute == option)]
            if kept:
                terms.append(f"{'blocks' if option == RECOMPUTE_BLOCK else option}:{','.join(kept)}")
        terms += [f"chunked-loss:{self.loss_chunk_rows}"] if self.loss_chunk_rows else []
        terms += [f"fused-loss:{self.loss_fused_rows}"] if self.loss_fused_rows else []
        return "+".join(terms) or "none"

    def describe(self, n_blocks: int) -> str:
        """A one-line account of which blocks the policy covers, for the training log."""
        if self.is_none:
            return "none: no block is checkpointed"
        parts = []
        regions = self.regions(n_blocks)
        for option in (RECOMPUTE_BLOCK, *OP_LEVEL):
            hit = [r for r in regions if r.recompute == option]
            if hit:
                spans = [f"{r.start}" if r.stop - r.start == 1 else f"{r.start}-{r.stop - 1}" for r in hit]
                parts.append(f"{option} recompute on {sum(r.stop - r.start for r in hit)}/{n_blocks} blocks [{', '.join(spans)}]")
        off = [r.start if r.stop - r.start == 1 else f"{r.start}-{r.stop - 1}" for r in regions if r.offload]
        if off:
            parts.append(f"offload on {off}")
        if self.loss_chunk_rows:
            parts.append(f"head+loss in chunks of {self.loss_chunk_rows} tokens")
        if self.loss_fused_rows:
            parts.append(f"head+loss fused, gradients in the forward, in chunks of {self.loss_fused_rows} tokens")
        return f"{self.spec}: " + "; ".join(parts)


def _int(text: str, term: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{term!r}: {text!r} is not an integer") from None
    if value < minimum:
        raise UserError(f"{term!r}: the number must be at least {minimum}")
    return value


def _ids(text: str, term: str) -> tuple[int, ...]:
    ids = tuple(_int(t.strip(), term, 0) for t in text.split(",") if t.strip())
    if not ids:
        raise UserError(f"{term!r}: give at least one block id, for example blocks:0,2")
    if len(set(ids)) != len(ids):
        raise UserError(f"{term!r}: a block id is repeated")
    return ids


def parse_policy(spec: str | Policy) -> Policy:
    """Parse a spec such as ``block``, ``every:2+chunked-loss`` or ``blocks:0,3+selective:1``."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"empty checkpointing policy {spec!r}; use 'none' for no checkpointing")
    spec = spec.strip().lower()
    terms = [t.strip() for t in spec.split("+")]
    if "none" in terms:
        if len(terms) > 1:
            raise UserError(f"'none' cannot be combined with other terms in {spec!r}")
        return Policy(spec="none")
    fields: dict[str, object] = {}

    def put(name: str, value: object, term: str) -> None:
        if name in fields:
            clash = "recompute selector" if name == "block" else f"{name} term"
            raise UserError(f"{spec!r} has more than one {clash} ({term!r}); use one")
        fields[name] = value

    for term in terms:
        head, _, arg = term.partition(":")
        head = head.replace("_", "-")
        if head == "block" and not arg:
            put("block", Selector("all"), term)
        elif head == "group":
            put("block", Selector("group", k=_int(arg, term, 1)), term)
        elif head == "every":
            put("block", Selector("every", k=_int(arg, term, 1)), term)
        elif head == "blocks":
            put("block", Selector("blocks", ids=_ids(arg, term)), term)
        elif head == "sqrt" and not arg:
            put("block", Selector("sqrt"), term)
        elif head in ("selective", "pointwise", "torchtitan", "offload"):
            put(head, Selector("blocks", ids=_ids(arg, term)) if arg else Selector("all"), term)
        elif head == "chunked-loss":
            put("loss_chunk_rows", _int(arg, term, 1) if arg else DEFAULT_LOSS_CHUNK_ROWS, term)
        elif head == "fused-loss":
            put("loss_fused_rows", _int(arg, term, 1) if arg else DEFAULT_LOSS_CHUNK_ROWS, term)
        else:
            raise UserError(
                f"unknown checkpointing term {term!r} in {spec!r}; expected none, block, group:K, every:K, "
                "blocks:i,j, sqrt, selective[:i,j], pointwise[:i,j], torchtitan[:i,j], offload[:i,j], chunked-loss[:ROWS] or "
                "fused-loss[:ROWS], joined by '+'"
            )
    if "loss_chunk_rows" in fields and "loss_fused_rows" in fields:
        raise UserError(f"{spec!r}: chunked-loss and fused-loss are two ways to run the head and loss; use one")
    _check_disjoint(spec, {name: fields[name] for name in ("block", *OP_LEVEL) if name in fields})
    return Policy(spec=spec, **fields)  # type: ignore[arg-type]


def _check_disjoint(spec: str, selectors: dict) -> None:
    """Each block gets one recompute option: two selectors may share no block (``every:K`` is checked once
    the number of blocks is known)."""
    names = list(selectors)
    for a_i, a in enumerate(names):
        for b in names[a_i + 1:]:
            sa, sb = selectors[a], selectors[b]
            if sa.kind in ("all", "group", "sqrt") or sb.kind in ("all", "group", "sqrt"):
                raise UserError(f"{spec!r} asks for {a} and {b} recompute on the same blocks; "
                                 f"give them disjoint block lists, e.g. blocks:0,1+{b}:2,3")
            overlap = set(sa.ids) & set(sb.ids) if sa.kind == sb.kind == "blocks" else set()
            if overlap:
                raise UserError(f"{spec!r}: blocks {sorted(overlap)} are both {a} and {b}; give each block one")
