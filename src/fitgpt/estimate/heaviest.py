"""Which fake ranks a plan must profile, and the profile that bounds them all.

Under FSDP or tensor parallelism every rank holds the same shapes, so one rank's step is every rank's: rank 0's,
which `fitgpt.optim.whole.owners` makes the one holding the most optimizer state. One thing breaks that symmetry:
a whole-matrix optimizer (every one but AdamW, and any over pure bf16 weights) stepped in the backward. Each matrix
is gathered and stepped by its owner inside the backward of the block it belongs to, so its temporaries land on one
rank at one moment of the step, and the heaviest rank is the one whose matrices are stepped when the most is alive,
not the one holding the most state (2 FSDP ranks, APOLLO-Mini over GPT-2's bf16 weights, a small vocabulary: rank 1
measured 933,300 bytes where rank 0's plan said 749,444). Such a plan profiles every rank that owns a matrix and
takes the profile whose every plan peaks where the heaviest rank does (`heaviest`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from fitgpt.config import OptimConfig
from fitgpt.estimate.ranks import fake_meshes
from fitgpt.estimate.source import ModelSource
from fitgpt.optim.whole import steps_whole

T = TypeVar("T")


def ranks_apart(source: ModelSource, optim: OptimConfig, world: int) -> range:
    """The fake ranks whose steps differ: rank 0 alone, unless ``optim`` steps whole matrices in the backward over
    ``world`` ranks, where each rank that owns a parameter (there are fewer parameters than ranks in a small model)."""
    if world == 1 or not optim.in_backward or optim.offload:
        return range(1)
    with torch.device("meta"):
        params = list(source.build().parameters())
    if not steps_whole(optim.name, any(p.dtype == torch.bfloat16 for p in params)):  # each rank's shard, alike
        return range(1)
    return range(min(world, len(params)))


def on_each_rank(source: ModelSource, optim: OptimConfig, world: int, tp: int, step: Callable[[Any, Any], T],
                 split: bool = True) -> list[T]:
    """``step(data-parallel mesh, tensor-parallel mesh)`` on ``world`` fake ranks in groups of ``tp``, as each rank
    `ranks_apart` sets apart (``split`` False: rank 0 alone, the model not split: DDP's replicas step alike)."""
    out = []
    for rank in ranks_apart(source, optim, world) if split else range(1):
        with fake_meshes(world, tp, rank) as (dp_mesh, tp_mesh):
            out.append(step(dp_mesh, tp_mesh))
    return out


RISES = ("embed_fwd_rise", "embed_bwd_rise", "optimizer_rise", "fwd_rise", "bwd_rise")
"""A profile's peaks above its running level (a block's or head's, in its options): where a rank's own step lands."""


def heaviest(profiles: list[Any]) -> Any:
    """One profile (a `fitgpt.estimate.profile.StepProfile`) whose every plan's predicted peak is the most any of
    ``profiles``' is (the heaviest rank's).

    Each peak is the baseline (weights, gradients and state held) plus a running level plus a rise. The ranks' levels
    are alike; their baselines and rises are not. Taken over the heaviest baseline's rank, each other rank's rises are
    raised by its baseline's difference (never below that rank's own), and each rise is the most any rank's is: the
    largest over the step's events and the largest over the ranks commute, so the peak of any plan is the most of
    the ranks' peaks. Levels that differ (none was seen to) are taken at their most: a bound still."""
    if len(profiles) == 1:  # every plan but a whole-matrix step in the backward's: nothing to merge
        return profiles[0]
    top = max(profiles, key=lambda p: p.baseline)
    return dataclasses.replace(_most([_raised(p, p.baseline - top.baseline) for p in profiles]),
                               **{k: getattr(top, k) for k in ("params", "optimizer", "grads", "baseline", "host")})


def _raised(value: Any, by: int) -> Any:
    """``value`` (a profile, or one of its options, lists or dicts) with each of its RISES raised ``by`` bytes."""
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: getattr(value, f.name) + by if f.name in RISES else
                                             _raised(getattr(value, f.name), by) for f in dataclasses.fields(value)})
    if isinstance(value, list):
        return [_raised(v, by) for v in value]
    if isinstance(value, dict):
        return {k: _raised(v, by) for k, v in value.items()}
    return value


def _most(values: list[Any]) -> Any:
    """Field by field, the largest of ``values`` (alike profiles, options, lists or dicts of them): byte counts,
    and seconds too (the slowest rank sets the step's pace)."""
    first = values[0]
    if dataclasses.is_dataclass(first):
        return dataclasses.replace(first, **{f.name: _most([getattr(v, f.name) for v in values])
                                             for f in dataclasses.fields(first)})
    if isinstance(first, list):
        return [_most(list(items)) for items in zip(*values, strict=True)]
    if isinstance(first, dict):
        return {k: _most([v[k] for v in values]) for k in first}
    if isinstance(first, (int, float)) and not isinstance(first, bool):
        return max(values)
    return first
