"""FSDP2 around a model, as training runs it and as planning profiles it (on a fake process group).

One function, so that the planner's per-rank profile shards exactly what the trainer shards: each block
(inside its activation-checkpoint wrapper, if it has one), then the root; parameters resharded after
the forward; the given mixed precision (parameters cast to ``param_dtype`` when gathered, gradients
reduced in fp32) and offload policy.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fitgpt.activation_checkpoint.apply import ActivationCheckpointWrapper, find_blocks


def precision_roles(dtype: torch.dtype | None, fsdp: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, FSDP parameter dtype) of a run in ``dtype``. Under FSDP, pure half precision: parameters gathered
    in ``dtype`` and every op run in it, no autocast (ops autocast would keep in fp32, norms and softmax among them,
    run in ``dtype``; the loss alone is computed in fp32), gradients reduced in fp32, weights and optimizer state kept
    in fp32: as torchtitan trains. Otherwise autocast over fp32 weights."""
    return (None, dtype) if fsdp else (dtype, None)


def fsdp_shard(model: nn.Module, param_dtype: torch.dtype | None, offload: bool = False, pin_memory: bool = False,
               mesh=None) -> nn.Module:
    """``fully_shard`` each block, then the root, in place (``mesh``: the ranks; default, the process group's)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None else MixedPrecisionPolicy()
    kw = {"mp_policy": mp, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(), "mesh": mesh}
    _, blocks = find_blocks(model)
    for block in blocks:
        # Shard the block itself, not its checkpoint wrapper: a group's first wrapper runs the
        # other blocks of its group directly, and their own hooks must gather their weights.
        fully_shard(block.inner if isinstance(block, ActivationCheckpointWrapper) else block, **kw)
    fully_shard(model, **kw)
    return model
