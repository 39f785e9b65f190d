"""Operation-level (selective) checkpointing: keep what is expensive to recompute, recompute the rest.

Like torchtitan's save list: the outputs of matmuls and attention kernels are kept; layer norms,
activations, dropout and element-wise ops are recomputed in the backward pass. Their FLOPs are a
rounding error next to the matmuls, while their outputs (B x T x 4C for GELU) are a large share of
the block's activations.
"""

from __future__ import annotations


import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

_aten = torch.ops.aten
SAVE_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn():
    """The ``context_fn`` handed to ``torch.utils.checkpoint.checkpoint`` for selective regions."""
    return create_selective_checkpoint_contexts(_policy)


