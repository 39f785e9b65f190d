"""CUDA's autocast rules, applied to the CPU tensors a CUDA step is planned on.

Autocast casts differently per device type. On CPU, ``cross_entropy`` is on the fp32 list (the logits
are copied to fp32 before the log-softmax); on CUDA it is on no list, so it runs as it decomposes:
``log_softmax`` with the logits' own dtype (kept in half precision), then ``nll_loss``, on CUDA's fp32
list. ``softmax``, ``layer_norm``, ``rms_norm``, ``exp``, ``pow``, ``sum``, ... are on CUDA's lists and
not on CPU's. A plan for a CUDA card profiled with CPU's rules gets those tensors' dtypes, and so
their bytes, wrong.

`cuda_autocast_rules` re-registers, for as long as it is entered, the CPU autocast kernel of every
op with a CUDA or CPU autocast kernel: each op gets the policy it has on CUDA, read from PyTorch's own
lists (the ``AT_FORALL_*`` macros of the installed ``ATen/autocast_mode.h``, from which PyTorch
registers its CUDA kernels; checked against the dispatcher's registrations), and an op with a kernel
on CPU only falls through, as it does on CUDA. The policies are implemented as ``autocast_mode.h``
implements them, weight-cast cache included (a parameter cast to half precision once per autocast
region, freed when the outermost region exits).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves, tree_map

log = logging.getLogger(__name__)

_LISTS = {"AT_FORALL_LOWER_PRECISION_FP": "lower_precision_fp", "AT_FORALL_FP32": "fp32",
          "AT_FORALL_FP32_SET_OPT_DTYPE": "fp32_set_opt_dtype", "AT_FORALL_PROMOTE": "promote"}
# Registered for CUDA in autocast_mode.cpp outside the shared lists: the cuDNN convolutions (which never
# run on CPU tensors) and binary_cross_entropy, which CUDA autocast refuses.
_CPP_ONLY = {"aten::cudnn_convolution": "lower_precision_fp", "aten::cudnn_convolution_transpose": "lower_precision_fp",
             "aten::binary_cross_entropy": "banned"}

# CUDA's composite softmax and log-softmax of fp16 into fp32 (SoftMax.cpp): one kernel, no copy of the input.
_HALF_TO_FLOAT = {"aten::softmax.int": torch.ops.aten._softmax.default, "aten::log_softmax.int": torch.ops.aten._log_softmax.default}


def _header() -> Path:
    return Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


@functools.cache
def cuda_policies() -> dict[str, str]:
    """``{"aten::op.overload": policy}`` for every op CUDA autocast handles, from the installed PyTorch's lists.

    Raises FileNotFoundError when the PyTorch install has no C++ headers (every PyPI and conda build has them).
    """
    text = _header().read_text()
    policies: dict[str, str] = {}
    for macro, policy in _LISTS.items():
        body = re.search(rf"#define {macro}\(_\)(.*?)(?<!\\)\n", text, re.S)
        if body is None:
            raise ValueError(f"{_header()} has no {macro}: this PyTorch's autocast lists moved")
        for name, overload in re.findall(r"_\((\w+)(?:,\s*(\w+))?\)", body.group(1)):
            policies[f"aten::{name}" + (f".{overload}" if overload else "")] = policy
    body = re.search(r"#define AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE\(_\)(.*?)(?<!\\)\n", text, re.S)
    for name, policy in re.findall(r'"([\w.]+)",.*?(fp32_append_dtype|fp32|lower_precision_fp)\)', body.group(1) if body else "",
                                   re.S):
        policies[f"aten::{name}"] = policy
    policies.update(_CPP_ONLY)
    return policies


def autocast_ops() -> dict[str, tuple[bool, bool]]:
    """Every ATen op with an autocast kernel registered in this process: ``{name: (on CPU, on CUDA)}``. Other
    libraries' ops (torchvision's, say) keep their own CPU autocast kernels: PyTorch's lists do not name them."""
    ops = {}
    for name in (n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")):
        dump = torch._C._dispatch_dump(name)
        cpu, cuda = "AutocastCPU:" in dump, "AutocastCUDA:" in dump
        if cpu or cuda:
            ops[name] = (cpu, cuda)
    return ops


def _packet_op(name: str):
    base, _, overload = name.removeprefix("aten::").partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


class _Rules:
    """The CUDA policies as kernels for the CPU autocast key, with autocast's weight-cast cache."""

    def __init__(self):
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def eligible(t) -> bool:
        """A tensor autocast may cast: floating point, not double, on the device autocast is for (here the CPU)."""
        return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() and t.dtype != torch.float64

    def cast(self, dtype: torch.dtype, t):
        """``cached_cast``: parameters (fp32 leaves that need gradients) cast to half precision once per region."""
        if not self.eligible(t) or t.dtype == dtype:
            return t
        cacheable = (dtype == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32 and t.requires_grad
                     and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())
        if not cacheable:
            return t.to(dtype)
        hit = self.cache.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self.cache[id(t)] = (t, t.to(dtype))
        return hit[1]

    def kernel(self, name: str, policy: str):
        op = _packet_op(name)

        def below_op(fn, *args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
                return fn(*args, **kwargs)

        def below(*args, **kwargs):
            return below_op(op, *args, **kwargs)

        def cast_all(dtype, args, kwargs):
            args, kwargs = tree_map(lambda a: self.cast(dtype, a), (args, kwargs))
            return below(*args, **kwargs)

        def first_eligible(args) -> bool:
            return bool(args) and self.eligible(args[0])

        if policy == "lower_precision_fp":
            return lambda *a, **k: cast_all(torch.get_autocast_dtype("cpu"), a, k)
        if policy == "fp32":
            return lambda *a, **k: cast_all(torch.float32, a, k)
        if policy == "promote":
            def promote(*a, **k):
                widest = torch.get_autocast_dtype("cpu")
                for t in tree_leaves((a, k)):
                    if self.eligible(t):
                        widest = torch.promote_types(widest, t.dtype)
                return cast_all(widest, a, k)
            return promote
        if policy == "fp32_set_opt_dtype":
            index = [arg.name for arg in op._schema.arguments].index("dtype")

            def set_opt_dtype(*a, **k):
                if first_eligible(a) and (a[index] if len(a) > index else k.get("dtype")) is None:
                    a, k = a[:index], {**k, "dtype": torch.float32}  # the dtype's slot is the last one these ops take
                dtype = a[index] if len(a) > index else k.get("dtype")
                if name in _HALF_TO_FLOAT and a[0].dtype == torch.float16 and dtype == torch.float32:
                    # CUDA's softmax reads fp16 and writes fp32 in one kernel; the CPU's copies the input to fp32 first.
                    return below_op(_HALF_TO_FLOAT[name], a[0], a[1], True)
                return below(*a, **k)
            return set_opt_dtype
        if policy == "fp32_append_dtype":
            with_dtype = _append_dtype_overload(op)
            return lambda *a, **k: below_op(with_dtype, *a, **k, dtype=torch.float32) if first_eligible(a) else below(*a, **k)
        if policy == "banned":
            def banned(*a, **k):
                raise RuntimeError(f"{name} is unsafe to autocast on CUDA (PyTorch refuses it there); use its "
                                   "_with_logits form, as CUDA autocast says")
            return banned
        raise ValueError(f"unknown autocast policy {policy!r} for {name}")


def _append_dtype_overload(op):
    """The overload a ``fp32_append_dtype`` op redispatches to: its own arguments and a ``dtype``."""
    packet = getattr(torch.ops.aten, op._schema.name.removeprefix("aten::"))
    want = [a.name for a in op._schema.arguments] + ["dtype"]
    for name in packet.overloads():
        candidate = getattr(packet, name)
        if [a.name for a in candidate._schema.arguments] == want:
            return candidate
    raise ValueError(f"{op} has no overload with a dtype")


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[None]:
    """While entered, CPU autocast casts as CUDA autocast does (see the module docstring): for a CUDA step
    profiled on CPU tensors. Process-wide (the dispatcher's table is), so nothing else should train meanwhile."""
    try:
        policies = cuda_policies()
    except FileNotFoundError:
        log.warning("this PyTorch install has no C++ headers (%s): CUDA's autocast lists cannot be read, so the CPU's "
                    "casts are planned (cross_entropy over-predicted by 2 bytes a logit)", _header())
        yield
        return
    rules, lib = _Rules(), torch.library.Library("aten", "IMPL")
    clear = torch.clear_autocast_cache

    def clear_both():  # autocast's own exit clears its cache at the outermost region: ours goes with it
        clear()
        rules.cache.clear()

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": that is the point
            for name, (cpu, cuda) in autocast_ops().items():
                short = name.removeprefix("aten::")
                if cuda:
                    lib.impl(short, rules.kernel(name, policies[name]), "AutocastCPU")
                elif cpu:
                    lib.impl(short, torch.library.fallthrough_kernel, "AutocastCPU")
        torch.clear_autocast_cache = clear_both
        yield
    finally:
        torch.clear_autocast_cache = clear
        rules.cache.clear()
        lib._destroy()
