"""FLOPs of a training step through ``FlopCounterMode``, attention on CPU included.

PyTorch has no FLOP formula for the CPU flash-attention kernel that ``scaled_dot_product_attention``
dispatches to, so it would silently count attention as free; we register the same formulas it uses
for the CUDA kernels.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

_aten = torch.ops.aten


def _register_cpu_attention() -> None:
    fwd = _aten._scaled_dot_product_flash_attention_for_cpu
    bwd = _aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd.default in flop_registry:
        return

    @register_flop_formula(fwd, get_raw=False)
    def _fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    @register_flop_formula(bwd, get_raw=False)
    def _bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)


_register_cpu_attention()
_CPU_ATTENTION = _aten._scaled_dot_product_flash_attention_for_cpu.default


def count_flops(fn, *args, **kwargs) -> int:
    """Total FLOPs of ``fn(*args, **kwargs)``, forward and any backward it runs."""
    with FlopCounterMode(display=False) as mode:
        fn(*args, **kwargs)
    return mode.get_total_flops()


OpCost = Callable[[object, tuple, dict, object, int], float]
"""Seconds one op takes: ``cost(func, args, kwargs, out, flops)`` (see ``fitgpt.estimate.timing``)."""


def op_flops(func, args: tuple, kwargs: dict, out) -> int:
    """FLOPs of one aten op by ``FlopCounterMode``'s formulas (0 for ops it has none for)."""
    formula = flop_registry.get(func._overloadpacket)
    return formula(*args, **kwargs, out_val=out) if formula is not None else 0


class OpFlops(TorchDispatchMode):
    """FLOPs of matmuls and attention seen by this mode, with ``FlopCounterMode``'s formulas, and with a
    ``cost`` model the seconds those ops take by it.

    ``FlopCounterMode`` also tracks modules, and that tracking keeps the graphs that checkpoint
    recomputation builds in the backward pass alive until the mode exits. Measured together with
    memory, it would inflate the very bytes checkpointing frees; this mode counts and holds nothing.
    """

    def __init__(self, cost: OpCost | None = None) -> None:
        super().__init__()
        self.total = 0
        self.seconds = 0.0
        self.cost = cost
        self.attention: list[tuple[tuple[int, ...], bool]] = []
        """Each CPU attention kernel call: (query shape (B, heads, T, head dim), given a mask). What a CUDA kernel
        would save instead depends on them (``fitgpt.estimate.hardware.attention_saved_delta``)."""

    def __enter__(self):
        self._propagating = 0
        self._restore = _quiet_while_propagating(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._restore()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            # A tensor-parallel rank's op: DTensor runs it as local ops on its shards, which this mode then sees. The
            # op itself has the whole tensors' shapes: counted here, each rank was given the whole model's FLOPs.
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._propagating:
            return out
        if func is _CPU_ATTENTION:
            self.attention.append((tuple(args[0].shape), kwargs.get("attn_mask") is not None))
        flops = op_flops(func, args, kwargs, out)
        self.total += flops
        if self.cost is not None:
            self.seconds += self.cost(func, args, kwargs, out, flops)
        return out


def _quiet_while_propagating(counter: OpFlops) -> Callable[[], None]:
    """While DTensor learns a new op's output shape it runs the op on fake tensors of the whole shapes (under the
    planner's own fake mode when there is one, so they look like the step's): ``counter`` counts nothing meanwhile.
    Returns what undoes it. Nothing to do where DTensor is not loaded: no tensor-parallel op can run."""
    prop = sys.modules.get("torch.distributed.tensor._sharding_prop")
    cls = getattr(prop, "ShardingPropagator", None)
    original = getattr(cls, "_propagate_tensor_meta_non_cached", None)
    if original is None:  # not loaded, or another layout of PyTorch's internals
        return lambda: None

    def propagate(self, op_schema):
        counter._propagating += 1
        try:
            return original(self, op_schema)
        finally:
            counter._propagating -= 1

    cls._propagate_tensor_meta_non_cached = propagate

    def restore() -> None:
        cls._propagate_tensor_meta_non_cached = original

    return restore
