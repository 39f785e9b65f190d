"""Operation-level (selective) checkpointing: keep what is expensive to recompute per byte, recompute the rest.

Kept: the outputs of attention kernels (their recompute is quadratic in the context) and of the
MLP's up-projection (a matmul that widens its input 4x or more: the block's largest tensor, and the
input GELU's backward needs). Recomputed in the backward pass: norms, activations, dropout,
residual sums, and the narrower matmuls (q/k/v and attention-output projections; the MLP's
output projection is never recomputed, as backward needs only its input). On a GPT-2 block this
keeps 6 of the 16 (B, T, C) tensors plain autograd keeps, for 8 C^2 FLOPs per token recomputed
out of 24 C^2 in the block's forward matmuls: under 1.10x the FLOPs of a GPT-2-small step.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

_aten = torch.ops.aten


def _ops(*names: str) -> frozenset:
    return frozenset(getattr(_aten, name).default for name in names if hasattr(_aten, name))


ATTENTION_OPS = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    # The math attention path (bmm of scores and values), e.g. Hugging Face's eager attention.
    "bmm",
    "baddbmm",
)
MATMUL_OPS = _ops("mm", "addmm", "_scaled_mm")
WIDENING = 4
"""A matmul whose output is at least this many times wider than its input is kept (the MLP's up-projection)."""


def _operands(op, args) -> tuple[torch.Tensor, torch.Tensor]:
    """A matmul's input and weight (addmm's first argument is its bias)."""
    return (args[1], args[2]) if op is _aten.addmm.default else (args[0], args[1])


def _widens(op, args) -> bool:
    a, b = _operands(op, args)
    return b.shape[-1] >= WIDENING * a.shape[-1]


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in ATTENTION_OPS or (op in MATMUL_OPS and _widens(op, args)):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """The ``context_fn`` handed to ``torch.utils.checkpoint.checkpoint`` for selective regions."""
    return create_selective_checkpoint_contexts(_policy)


def _contracted(op, args) -> int:
    """The width a matmul contracts over (its input's features)."""
    return _operands(op, args)[0].shape[-1]


def pointwise_context_fn(width: int, dropout: bool):
    """The ``context_fn`` for pointwise regions: recompute only what is not a matmul or attention.

    Matmul and attention outputs are kept, so backward reruns only the cheap element-wise ops (norms, GELU,
    dropout with its RNG replayed, residual adds) and never a matmul. One matmul needs no keeping: the MLP's
    down-projection, the only one that contracts a dimension wider than the region's residual stream (``width``,
    its input's features; GQA's narrow k/v projections contract the stream itself and are kept). Its output
    only feeds a residual sum whose backward needs no input, so nothing asks to recompute it, unless ``dropout``
    follows it (the region has active dropout): then recomputing the dropout would rerun the matmul, and its
    output is kept too."""

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMUL_OPS and (dropout or _contracted(op, args) <= width):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


TORCHTITAN_SAVED = _ops(
    "mm",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "_scaled_dot_product_fused_attention_overrideable",
    # Not on torchtitan's list, which is CUDA's: the CPU's kernel stands for the CUDA one a planned step would run.
    "_scaled_dot_product_flash_attention_for_cpu",
) | frozenset(
    op.default for op in [getattr(getattr(torch.ops, "_c10d_functional", None), "reduce_scatter_tensor", None)] if op is not None
)


def torchtitan_context_fn():
    """torchtitan's op-level selective rule (``ac_mode="selective"``, ``selective_ac_option="op"``), for comparing like
    with like: keep the output of every attention kernel and of every second ``mm`` (the 1st, 3rd, ... of the region,
    counted apart in the forward and in the recompute), recompute everything else. ``addmm`` (a linear layer with a
    bias) is not on its list: never kept. One count per region call, as torchtitan makes one per layer."""
    counts: Counter = Counter()

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op is _aten.mm.default:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in TORCHTITAN_SAVED else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
