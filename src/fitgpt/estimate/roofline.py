"""The roofline: per-op costs on a CUDA card not at hand, from its datasheet. Each op takes max(FLOPs / peak, bytes /
bandwidth) at the card's figures times a typical achieved fraction, plus a launch cost; float8 matmuls (--float8) at
twice the bf16 peak where the card has them. An estimate, and named as one wherever it is shown. An offloaded
optimizer's host (``--optim.offload``) is planned on the meta device: a copy between it and the card takes its
bytes over the card's host link. (Measured costs, on the device at hand: `fitgpt.estimate.timing`.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves

from fitgpt.estimate.hardware import GPU, GPUS

ROOFLINE_MATMUL, ROOFLINE_MEMORY, LAUNCH = 0.6, 0.75, 5e-6
"""Typical achieved fractions of a card's peak FLOP/s (large bf16 GEMMs reach 60-75%) and bandwidth, and the
cost of launching one kernel: the roofline's assumptions."""
SCALED_MM = torch.ops.aten._scaled_mm
"""A float8 matmul (torchao's Float8Linear calls it)."""


def is_free(func) -> bool:
    """Ops that move no data: views, allocations whose contents are not written, metadata queries."""
    return func.is_view or func._overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided,
                                                   torch.ops.aten.empty_like)


def is_counted(func) -> bool:
    """Ops a real step dispatches: fake tensors also dispatch metadata queries (``prim.device``) a real run does not."""
    return func.namespace != "prim"


def moved_bytes(args: tuple, kwargs: dict, out) -> int:
    """Bytes an op reads and writes: its tensor inputs and outputs (what a roofline charges)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))


@dataclass
class Roofline:
    """Per-op costs on a CUDA card from its datasheet: ``LAUNCH + max(FLOPs * per_flop, bytes * per_byte)``."""

    per_flop: float
    per_byte: float
    source: str
    per_link_byte: float = 1 / 32e9
    """Seconds per byte over the card's host link (one direction)."""
    per_fp8_flop: float | None = None
    """Seconds per FLOP of a float8 matmul (``_scaled_mm``, --float8): twice the bf16 rate on a card that has them."""
    recompute_overhead: dict[str, float] = field(default_factory=dict)
    """None estimated: on a card the checkpoint machinery's Python runs while the kernels queue."""

    def __call__(self, func, args: tuple, kwargs: dict, out, flops: int) -> float:
        if is_free(func) or not is_counted(func):
            return 0.0
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors):  # the offloaded optimizer's host (see the module's doc)
            if all(t.device.type == "meta" for t in tensors):
                return 0.0
            return max(t.nbytes for t in tensors) * self.per_link_byte  # one tensor copied across
        per_flop = self.per_fp8_flop if self.per_fp8_flop and func._overloadpacket is SCALED_MM else self.per_flop
        return LAUNCH + max(flops * per_flop, moved_bytes(args, kwargs, out) * self.per_byte)


def roofline(gpu: GPU | None, dtype: torch.dtype | None) -> Roofline:
    """The card's roofline: FLOPs at the tensor-core peak under bf16/fp16 autocast (FP32 peak otherwise), bytes
    at its bandwidth, each at a typical achieved fraction. An unnamed card is costed as an A100 80GB."""
    gpu = gpu or GPUS["a100-80gb"]
    peak = gpu.half_flops if dtype in (torch.float16, torch.bfloat16) else gpu.fp32_flops
    return Roofline(1 / (peak * ROOFLINE_MATMUL), 1 / (gpu.bandwidth * ROOFLINE_MEMORY),
                    f"estimated: roofline of {gpu.name} ({peak / 1e12:.0f} TFLOP/s x {ROOFLINE_MATMUL:.0%}, "
                    f"{gpu.bandwidth / 1e12:.2f} TB/s x {ROOFLINE_MEMORY:.0%}, {LAUNCH * 1e6:.0f} us a kernel)",
                    per_link_byte=1 / gpu.pcie, per_fp8_flop=1 / (2 * gpu.half_flops * ROOFLINE_MATMUL) if gpu.fp8 else None)
