"""FLOPs of a training step through ``FlopCounterMode``, attention on CPU included.

PyTorch has no FLOP formula for the CPU flash-attention kernel that ``scaled_dot_product_attention``
dispatches to, so it would silently count attention as free; we register the same formulas it uses
for the CUDA kernels.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

_aten = torch.ops.aten


def _register_cpu_attention() -> None:
    fwd = _aten._scaled_dot_product_flash_attention_for_cpu
    bwd = _aten._scaled_dot_product_flash_attention_for_cpu_backward
    from torch.utils.flop_counter import flop_registry

    if fwd.default in flop_registry:
        return

    @register_flop_formula(fwd, get_raw=False)
    def _fwd(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    @register_flop_formula(bwd, get_raw=False)
    def _bwd(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)


_register_cpu_attention()


def count_flops(fn, *args, **kwargs) -> int:
    """Total FLOPs of ``fn(*args, **kwargs)``, forward and any backward it runs."""
    with FlopCounterMode(display=False) as mode:
        fn(*args, **kwargs)
    return mode.get_total_flops()
