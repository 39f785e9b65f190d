"""Devices and precision, shared by training, planning and sampling: which device, which autocast, how much memory."""

from __future__ import annotations

import contextlib
import resource
import sys
from collections.abc import Callable

import torch

from fitgpt.errors import UserError


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (set --device to auto, cpu, cuda or mps)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {name}, but this torch build sees no CUDA device; use --device cpu or auto")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {name}, but this machine has {torch.cuda.device_count()} CUDA device(s); use --device cuda")
    mps = getattr(torch.backends, "mps", None)
    if device.type == "mps" and not (mps is not None and mps.is_available()):
        raise UserError(f"--device {name}, but MPS (Apple GPUs) is not available here; use --device cpu or auto")
    if device.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {name}: fitgpt runs on cpu, cuda or mps; use --device auto")
    return device


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32."""
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    if precision == "fp16" and device.type == "cpu":
        raise UserError("--precision fp16 needs a GPU; on CPU use bf16 or fp32")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def peak_memory(device: torch.device) -> tuple[str, int]:
    """The peak to log, named for what it counts: on CUDA the tensors' (``peak_allocated``, max_memory_allocated, as
    the planner predicts it); elsewhere the process's resident memory (``peak_rss``: weights, data pages, libraries)."""
    if device.type == "cuda":
        return "peak_allocated", torch.cuda.max_memory_allocated(device)
    # ru_maxrss counts kilobytes on Linux, bytes on macOS.
    return "peak_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def autocast(device: torch.device, dtype: torch.dtype | None) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the forward pass's autocast context (a no-op for fp32): one definition for train, plan and bench."""
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def loss_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits a loss is computed from: half-precision logits outside autocast (pure bf16 under FSDP) in fp32, as
    torchtitan computes its loss; under autocast as they are (autocast decides: fp32 on CPU, while CUDA keeps the
    log-softmax in half precision)."""
    if logits.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(logits.device.type):
        return logits.float()
    return logits


def is_host_oom(e: BaseException) -> bool:
    """PyTorch's CPU allocator failing (a RuntimeError, where CUDA raises torch.OutOfMemoryError)."""
    return isinstance(e, RuntimeError) and "can't allocate memory" in str(e)
