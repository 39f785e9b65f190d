"""Planning for a CUDA card from a CPU: each modelled part, on tiny configs, with exact numbers."""

import json
import math

import pytest
import torch

from fitgpt.cli import main
from fitgpt.cli.workload import BudgetConfig
from fitgpt.errors import UserError
from fitgpt.estimate.hardware import CUDA_CONTEXT, GPUS, Target, attention_saved_delta, find_gpu
from fitgpt.estimate.profile import profile_model
from fitgpt.plan.solver import Plan, predict

H100, A100, T4 = (Target("cuda", find_gpu(n)) for n in ("h100-80gb", "a100-40gb", "t4"))


def _r(n: int) -> int:
    return math.ceil(n / 512) * 512


def _cuda_profile(cfg, target, dtype, batch=4, context=32, **kw):
    return profile_model(cfg, batch, context, "cpu", dtype=dtype, fake=True, target=target, **kw)


@pytest.mark.parametrize("target, dtype, head_dim, backend", [
    (H100, torch.bfloat16, 64, "flash"), (A100, torch.float16, 128, "flash"), (A100, None, 64, "efficient"),
    (T4, torch.float16, 64, "efficient"), (T4, torch.bfloat16, 64, "math"), (H100, torch.bfloat16, 512, "efficient"),
    (H100, torch.bfloat16, 60, "flash"), (Target("cpu"), torch.bfloat16, 64, "cpu-flash"),
])
def test_attention_backend_follows_pytorchs_rules(target, dtype, head_dim, backend):
    assert target.attention_backend(dtype, head_dim) == backend


def test_attention_saved_delta_is_what_the_kernels_meta_versions_return():
    B, H, T, D = 2, 4, 40, 64
    # Flash: log-sum-exp (B, H, T) fp32 like the CPU kernel, plus the RNG state (2 x uint64) and its offset (uint64).
    assert attention_saved_delta("flash", B, H, T, D, torch.bfloat16, 512) == _r(16) + _r(8)
    assert attention_saved_delta("flash", B, H, T, D, torch.bfloat16, 1) == 16 + 8
    # Memory-efficient: log-sum-exp rows padded to a multiple of 32 (40 -> 64), seed and offset (int64 each).
    assert attention_saved_delta("efficient", B, H, T, D, None, 1) == B * H * (64 - 40) * 4 + 8 + 8
    assert attention_saved_delta("efficient", B, H, T, D, None, 512) == _r(B * H * 64 * 4) + 2 * _r(8) - _r(B * H * 40 * 4)
    assert attention_saved_delta("math", B, H, T, D, None, 512) == 0  # profiled as the math path itself


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_cuda_profiles_count_allocator_blocks_and_fused_adamw(tiny_model_config):
    cfg = tiny_model_config(n_embed=40, n_head=5, vocab_size=200)  # sizes that are not multiples of 512 bytes
    from fitgpt.model import Transformer

    params = list({id(p): p for p in Transformer(cfg).parameters()}.values())
    exact = sum(p.numel() * 4 for p in params)
    blocks = sum(_r(p.numel() * 4) for p in params)
    assert blocks > exact
    cpu = _cuda_profile(cfg, Target("cpu"), None)
    cuda = _cuda_profile(cfg, A100, None)
    assert (cpu.params, cuda.params) == (exact, blocks)
    # AdamW: two moments per parameter, and a float32 step counter: a CPU scalar unfused, one device block each fused.
    assert cpu.optimizer == 2 * exact + 4 * len(params)
    assert cuda.optimizer == 2 * blocks + 512 * len(params)


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_the_math_backend_keeps_the_attention_matrix(tiny_model_config):
    cfg = tiny_model_config()
    B, T = 4, 32
    flash = _cuda_profile(cfg, H100, torch.bfloat16, B, T).blocks[0]["none"].saved
    math_ = _cuda_profile(cfg, T4, torch.bfloat16, B, T).blocks[0]["none"].saved
    assert math_ - flash >= B * cfg.n_head * T * T * 2  # at least the (B, H, T, T) bf16 softmax


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_autocast_weight_copies_and_flash_rng_state_are_counted(tiny_model_config):
    from fitgpt.model import Transformer

    cfg = tiny_model_config()
    B, T = 4, 32
    cuda = _cuda_profile(cfg, H100, torch.bfloat16, B, T).blocks[1]
    # A recomputed block keeps its output (B, T, C) fp32 for backward; autocast's cache holds a bf16 copy of
    # every Linear weight and bias it used until the forward ends: each one allocator block, rounded.
    linears = [m for m in Transformer(cfg).attn_blocks[1].modules() if isinstance(m, torch.nn.Linear)]
    copies = sum(_r(p.numel() * 2) for m in linears for p in (m.weight, m.bias) if p is not None)
    assert cuda["block"].saved == _r(B * T * cfg.n_embed * 4)
    assert cuda["block"].transient == copies
    # Flash on CUDA keeps its RNG state besides what the CPU kernel keeps: one more block for each of two tensors.
    cpu_like = profile_model(cfg, B, T, "cpu", dtype=torch.bfloat16, fake=True, target=Target("cuda"))
    assert cpu_like.device == "cuda"
    plain = profile_model(cfg, B, T, "cpu", dtype=torch.bfloat16, fake=True, target=Target("cpu")).blocks[1]
    assert cuda["none"].saved - cuda["block"].saved > plain["none"].saved - plain["block"].saved


def test_precision_auto_is_fp16_on_cards_without_bf16():
    assert T4.autocast_dtype("auto") == torch.float16
    assert H100.autocast_dtype("auto") == torch.bfloat16
    assert Target("cpu").autocast_dtype("auto") is None
    with pytest.raises(UserError, match="has no bf16"):  # asked for on a card without it: refused (was planned silently)
        T4.autocast_dtype("bf16")


def test_budget_from_the_card_leaves_the_context_and_workspaces():
    cfg = BudgetConfig(gpu="h100-80gb")
    assert cfg.budget == GPUS["h100-80gb"].memory - CUDA_CONTEXT - 2 * 32 * 2**20
    t4 = BudgetConfig(gpu="t4", memory_budget="15GiB")
    assert t4.budget == 15 * 2**30 - 2 * (8 * 2**20 + 128 * 2**10)
    assert BudgetConfig(memory_budget="1GiB").budget == 2**30  # CPU: nothing besides the tensors


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_for_a_card_from_this_cpu(capsys):
    assert main(["plan", "--preset", "tiny", "--gpu", "a100-40gb", "--batch-size", "4", "--context", "64"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["target"] == "cuda" and result["fake"] and result["gpu"] == "a100-40gb"
    assert "modelled: attention backend flash" in out and "Measured: nothing on a GPU" in out
    assert result["predicted_max_allocated"] == result["predicted_peak"] + 2 * (8 * 2**20 + 128 * 2**10)


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_per_rank_plans_for_cuda_without_processes(tiny_model_config):
    ranks = BudgetConfig(gpu="h100-80gb", world_size=4, parallel="fsdp", batch_size=2, context=32).workload.profile()
    one = BudgetConfig(gpu="h100-80gb", batch_size=2, context=32).workload.profile()
    n = one.n_blocks
    assert predict(ranks, Plan.uniform(n, "none")).peak < predict(one, Plan.uniform(n, "none")).peak


@pytest.mark.parametrize("args, match", [
    (["--gpu", "h100"], "unknown GPU 'h100'; choose one of h100-80gb"),
    (["--gpu", "t4", "--device", "cpu"], "--device measures on this machine"),
    (["--gpu", "t4", "--target", "cpu"], "drop --target cpu"),
    ([], "--memory-budget is required"),
])
def test_target_errors_name_the_flag(args, match, capsys):
    assert main(["plan", "--preset", "tiny", *args]) == 2
    assert match in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_measuring_on_a_missing_device_points_to_target(capsys):
    assert main(["plan", "--preset", "tiny", "--device", "cuda", "--memory-budget", "1GiB"]) == 2
    assert "use --target cuda or --gpu NAME instead of --device" in capsys.readouterr().err


def test_a_card_not_in_the_table_is_the_nearest_one_with_its_own_memory(capsys):
    """--gpu-memory gives the card's memory, --gpu the nearest card for the rest; the H100 NVL and 96 GB are in the table."""
    assert GPUS["h100-nvl"].memory == 95830 * 2**20 and GPUS["h100-96gb"].sm == (9, 0)
    capsys.readouterr()
    assert main(["plan", "--preset", "tiny", "--gpu", "a100-80gb", "--gpu-memory", "48GiB"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["budget"] <= 48 * 2**30 - CUDA_CONTEXT - 2 * (8 * 2**20 + 128 * 2**10)
    assert "card: a100-80gb with 48.00 GiB, 48.00 GiB, sm 8.0" in out
    for args, match in ((["--gpu-memory", "48GiB"], "add --gpu NEAREST"), (["--gpu", "l4", "--gpu-memory", "100MB"], "CUDA context"),
                        (["--gpu", "l4", "--gpu-memory", "lots"], "--gpu-memory")):
        assert main(["plan", "--preset", "tiny", *args]) == 2
        err = capsys.readouterr().err
        assert match in err and len(err.strip().splitlines()) == 1, err
