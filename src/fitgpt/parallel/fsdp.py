"""FSDP2 around a model, as training runs it and as planning profiles it (on a fake process group): each block
sharded (inside its activation-checkpoint wrapper, if it has one), then the root; parameters resharded after the
forward; the given mixed precision (parameters cast to ``param_dtype`` when gathered, gradients reduced in fp32)
and offload policy. And what a sharded model needs besides: its blocks compiled one by one, its weights drawn on
each rank as one process draws them."""

from __future__ import annotations

import torch
import torch.nn as nn

from fitgpt.activation_checkpoint.apply import ActivationCheckpointWrapper, find_blocks
from fitgpt.float8 import gather_in_float8
from fitgpt.model.transformer import fill_whole
from fitgpt.parallel.placement import assign_whole


def precision_roles(dtype: torch.dtype | None, fsdp: bool) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(autocast dtype, FSDP parameter dtype) of a run in ``dtype``. Under FSDP, pure half precision: parameters gathered
    in ``dtype`` and every op run in it, no autocast (ops autocast would keep in fp32, norms and softmax among them,
    run in ``dtype``; the loss alone is computed in fp32), gradients reduced in fp32, weights and optimizer state kept
    in fp32: as torchtitan trains. Otherwise autocast over fp32 weights."""
    return (None, dtype) if fsdp else (dtype, None)


def fsdp_shard(model: nn.Module, param_dtype: torch.dtype | None, offload: bool = False, pin_memory: bool = False,
               mesh=None, reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each block, then the root, in place (``mesh``: the ranks; default, the process group's).
    ``reshard_after_forward`` False: each block's gathered weights kept from its forward to its backward (one
    all-gather a step fewer, a block's whole weights more held each), as torchtitan runs under pipeline parallelism;
    the root's (the embedding, the final norm and the head) are kept either way, as FSDP2 keeps a root's. Float8
    linears with tensorwise scales are all-gathered in float8 (`fitgpt.float8.gather_in_float8`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype is not None else MixedPrecisionPolicy()
    kw = {"mp_policy": mp, "offload_policy": CPUOffloadPolicy(pin_memory=pin_memory) if offload else OffloadPolicy(), "mesh": mesh}
    gather_in_float8(model)  # --float8 tensorwise: weights all-gathered in float8, as torchtitan gathers them
    _, blocks = find_blocks(model)
    for block in blocks:
        # Shard the block itself, not its checkpoint wrapper: a group's first wrapper runs the
        # other blocks of its group directly, and their own hooks must gather their weights.
        fully_shard(block.inner if isinstance(block, ActivationCheckpointWrapper) else block, **kw,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, **kw)
    return model


def compile_blocks(model: nn.Module) -> None:
    """``torch.compile`` each block's forward, in place, as torchtitan compiles a model FSDP shards: the compiled code
    is one block's arithmetic, run inside its checkpointing wrapper (recomputed as compiled code) and between FSDP's
    hooks, which gather and free the block's weights eagerly. Names and the state dict are unchanged. A pipeline
    stage's placeholders for other stages' blocks (no parameters) are left as they are."""
    _, blocks = find_blocks(model)
    for block in blocks:
        inner = block.inner if isinstance(block, ActivationCheckpointWrapper) else block
        if isinstance(inner, nn.Identity):
            continue
        inner.forward = torch.compile(inner.forward)


@torch.no_grad()
def fill_shard(p: torch.Tensor, std: float | None) -> None:
    """A `Transformer.init_weights` fill for a model sharded by ``fsdp_shard``: the whole parameter drawn on the CPU,
    as one process draws it, and this rank's shard of it kept (every rank draws alike, so no rank sends anything).
    One parameter whole at a time, never the model."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        fill_whole(p, std)
        return
    whole = torch.empty(p.shape, dtype=p.dtype)
    fill_whole(whole, std)
    assign_whole(p, whole)


def materialise(model: nn.Module, device: torch.device, seed: int) -> None:
    """A model built on the meta device and sharded: each rank's shards allocated on ``device`` and filled with the
    initial weights one process would draw from ``seed`` (its ``init_weights``)."""
    ties = _ties(model)
    model.to_empty(device=device)
    for module, name, (first, first_name) in ties:  # FSDP2 keeps a tied weight one; a plain to_empty makes it two
        if getattr(module, name) is not getattr(first, first_name):
            setattr(module, name, getattr(first, first_name))
    torch.manual_seed(seed)
    model.init_weights(fill_shard)


def _ties(model: nn.Module) -> list[tuple[nn.Module, str, tuple[nn.Module, str]]]:
    """Each parameter registered a second time (a tied head), with where it was first."""
    first: dict[int, tuple[nn.Module, str]] = {}
    ties = []
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in first:
                ties.append((module, name, first[id(p)]))
            elif p is not None:
                first[id(p)] = (module, name)
    return ties
