"""What a CUDA card changes in a block's profiled options, on the CPU the profile ran on: what its attention kernels
save beyond the CPU's, and a block that offloads what autograd saves over the card's host link."""

from __future__ import annotations

import dataclasses

import torch

from fitgpt.estimate.hardware import Target, attention_saved_delta
from fitgpt.estimate.options import BlockOption


def with_cuda_attention(block: dict[str, BlockOption], target: Target, dtype: torch.dtype | None,
                        calls: tuple) -> dict[str, BlockOption]:
    """A block's options with what the CUDA attention kernel saves beyond the CPU one we ran, for each attention
    call its forward made (``calls``: query shape, masked): kept until backward where the block keeps its attention
    (none, selective), made again in its backward where the block is recomputed (block)."""
    delta = 0
    for (b, heads, t, head_dim), masked in calls:
        backend = target.attention_backend(dtype, head_dim)
        # CUDA's flash kernel takes no mask: given one, PyTorch picks the memory-efficient kernel.
        backend = "efficient" if masked and backend == "flash" else backend
        delta += attention_saved_delta(backend, b, heads, t, head_dim, dtype, target.round_to)
    if delta == 0:
        return block

    def adjust(option: str, o: BlockOption) -> BlockOption:
        if option == "block":
            return dataclasses.replace(o, bwd_rise=o.bwd_rise + delta)
        return dataclasses.replace(o, saved=o.saved + delta, fwd_rise=o.fwd_rise + delta)

    return {k: adjust(k, o) for k, o in block.items()}


def offload_option(none: BlockOption, out: int, target: Target) -> BlockOption:
    """A block that keeps its activations (none) but sends what autograd saves to pinned host memory
    (``save_on_cpu``), modelled, not profiled (on the CPU we profile on, offload is no copy at all): nothing
    stays on the card but its output until the next block has read it; its backward brings everything back
    first. The copies run on the compute stream (``save_on_cpu`` does not overlap them), out in the forward
    and back in the backward, at the card's host-link bandwidth."""
    pcie = target.gpu.pcie if target.gpu else 32e9
    # ``saved`` is the block's net bytes past its forward: negative where it frees more than it keeps (under FSDP at
    # many ranks, the previous block's padded gathers). That part is no copy, and stays freed.
    copied = max(0, none.saved)
    return dataclasses.replace(none, saved=none.saved - copied, fwd_rise=none.fwd_rise + out,
                               bwd_rise=none.bwd_rise + copied, time=none.time + 2 * copied / pcie)
