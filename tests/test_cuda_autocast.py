"""CUDA's autocast rules on the CPU tensors a CUDA step is planned on: the same casts, op by op, as PyTorch's
own CUDA autocast kernels make (run here on fake CUDA tensors, which need no GPU without autograd)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fitgpt.estimate import profile as profile_module
from fitgpt.estimate.cuda_autocast import autocast_ops, cuda_autocast_rules, cuda_policies
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.profile import profile_model
from fitgpt.plan.solver import Plan, predict


class _Trace(TorchDispatchMode):
    """Each op that makes tensors: (name, input dtypes, output dtypes)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))

        def dtypes(x):
            return tuple(t.dtype for t in tree_leaves(x) if isinstance(t, torch.Tensor))

        if dtypes(out):  # not the device queries CUDA's eligibility checks make
            self.ops.append((func.__name__, dtypes((args, kwargs)), dtypes(out)))
        return out


B, T, C, V = 2, 8, 16, 32
CASES = {
    "linear": lambda x, w, i: F.linear(x, w),
    "matmul": lambda x, w, i: x @ w.t(),
    "cross_entropy": lambda x, w, i: F.cross_entropy(F.linear(x, w).view(-1, V), i.view(-1)),
    "log_softmax": lambda x, w, i: F.log_softmax(F.linear(x, w), -1),
    "softmax": lambda x, w, i: F.softmax(F.linear(x, w), -1),
    "layer_norm": lambda x, w, i: F.layer_norm(F.linear(x, w), (V,)),
    "rms_norm": lambda x, w, i: F.rms_norm(F.linear(x, w), (V,)),
    "rms_norm_by_hand": lambda x, w, i: torch.rsqrt(F.linear(x, w).pow(2).mean(-1, keepdim=True) + 1e-6),
    "gelu": lambda x, w, i: F.gelu(F.linear(x, w), approximate="tanh"),
    "silu": lambda x, w, i: F.silu(F.linear(x, w)),
    "embedding": lambda x, w, i: F.embedding(i, w),
    "sum": lambda x, w, i: F.linear(x, w).sum(),
    "sum_with_dtype": lambda x, w, i: F.linear(x, w).sum(-1, dtype=torch.bfloat16),
    "exp": lambda x, w, i: torch.exp(F.linear(x, w)),
    "norm": lambda x, w, i: torch.norm(F.linear(x, w)),
    "baddbmm": lambda x, w, i: torch.baddbmm(x @ x.transpose(1, 2), x, x.transpose(1, 2)),
    "einsum": lambda x, w, i: torch.einsum("btc,vc->btv", x, w),
    "addcmul_promotes": lambda x, w, i: torch.addcmul(x, x.bfloat16(), x),
}


def _trace(fn, device: str, dtype: torch.dtype) -> list:
    with FakeTensorMode(), torch.no_grad():
        args = torch.empty(B, T, C, device=device), torch.empty(V, C, device=device), torch.zeros(B, T, dtype=torch.long, device=device)
        torch.set_autocast_enabled(device, True)
        torch.set_autocast_dtype(device, dtype)
        try:
            with _Trace() as trace:
                fn(*args)
        finally:
            torch.set_autocast_enabled(device, False)
            torch.clear_autocast_cache()
    return trace.ops


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_each_op_casts_as_cuda_autocast_does(case, dtype):
    cuda = _trace(CASES[case], "cuda", dtype)  # PyTorch's own CUDA autocast kernels
    with cuda_autocast_rules():
        ours = _trace(CASES[case], "cpu", dtype)
    assert ours == cuda


def test_cross_entropy_keeps_the_log_softmax_in_half_precision_on_cuda_only():
    bf16, f32 = torch.bfloat16, torch.float32
    cuda = _trace(CASES["cross_entropy"], "cuda", bf16)
    assert ("_log_softmax.default", (bf16,), (bf16,)) in cuda  # then nll_loss's input alone is cast up
    assert ("nll_loss_forward.default", (f32, torch.int64), (f32, f32)) in cuda
    cpu = _trace(CASES["cross_entropy"], "cpu", bf16)  # CPU's rules: the logits go to fp32 first
    assert ("_log_softmax.default", (f32,), (f32,)) in cpu
    with cuda_autocast_rules():
        pass
    assert _trace(CASES["cross_entropy"], "cpu", bf16) == cpu  # leaving the rules restores the CPU's


def test_the_lists_are_this_pytorchs_cuda_registrations():
    registered = {name for name, (_, cuda) in autocast_ops().items() if cuda}
    assert set(cuda_policies()) == registered
    p = cuda_policies()
    assert p["aten::scaled_dot_product_attention"] == p["aten::linear"] == "lower_precision_fp"
    assert p["aten::layer_norm"] == p["aten::rms_norm"] == p["aten::nll_loss"] == "fp32"
    assert p["aten::softmax.int"] == p["aten::log_softmax.int"] == "fp32_set_opt_dtype"
    assert "aten::cross_entropy_loss" not in p and "aten::gelu" not in p and "aten::silu" not in p


def test_sdpa_runs_in_half_precision():  # its fake CUDA kernel needs a card to pick a backend: pinned here
    q = torch.randn(1, 2, 8, 4)
    with cuda_autocast_rules(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert F.scaled_dot_product_attention(q, q, q, is_causal=True).dtype == torch.bfloat16


class _Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


def test_a_weight_is_cast_once_per_autocast_region():
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4).bfloat16()
    with cuda_autocast_rules():
        for _ in range(2):  # two regions: the cache is dropped as each one exits
            with torch.autocast("cpu", dtype=torch.bfloat16), _Casts() as casts:
                F.linear(x, w)
                F.linear(x, w)
            assert casts.n == 1


@pytest.mark.slow  # 3.2-3.4 s here
def test_a_cuda_plan_counts_the_head_as_cuda_runs_it(tiny_model_config, monkeypatch):
    cfg = tiny_model_config(vocab_size=256)
    batch, context = 4, 32
    h100 = Target("cuda", find_gpu("h100-80gb"))

    def peak() -> int:
        prof = profile_model(cfg, batch, context, "cpu", dtype=torch.bfloat16, fake=True, target=h100)
        return predict(prof, Plan(("none",) * cfg.n_blocks, "plain")).peak

    cuda = peak()
    monkeypatch.setattr(profile_module, "cuda_autocast_rules", contextlib.nullcontext)  # the CPU's rules, as before
    cpu = peak()
    # The head backward's peak. CPU's rules (logits copied to fp32, an fp32 log-softmax): at the log-softmax's
    # backward, its saved fp32 output, the incoming fp32 gradient and the outgoing one, 12 bytes a logit. CUDA's
    # (a bf16 log-softmax, its output copied to fp32 for nll_loss): at nll_loss's backward, the saved bf16 output
    # and fp32 copy and the fp32 gradient, 10 bytes a logit, with two scalars still alive there (the loss's
    # gradient, nll_loss's total weight: one 512-byte allocator block each).
    assert cpu - cuda == 2 * batch * context * cfg.vocab_size - 2 * 512
