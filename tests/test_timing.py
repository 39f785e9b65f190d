"""The time model: per-op costs, their sum over a profile's segments, and the fastest plan it picks."""

import itertools

import pytest
import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.estimate.hardware import GPUS
from fitgpt.estimate.profile import BLOCK_OPTIONS, HEAD_OPTIONS, profile_model
from fitgpt.estimate.roofline import LAUNCH, ROOFLINE_MATMUL, ROOFLINE_MEMORY, roofline
from fitgpt.estimate.timing import _fit_rates, _line
from fitgpt.memory.fake import fake_mode
from fitgpt.memory.flops import OpFlops
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.plan import Plan, predict, solve, solve_exhaustive
from fitgpt.step import train_step

H100 = GPUS["h100-80gb"]


def test_roofline_costs_ops_by_flops_or_bytes_at_the_cards_figures():
    cost = roofline(H100, torch.bfloat16)
    with fake_mode():
        a = torch.empty(1024, 2048, dtype=torch.bfloat16)
        b = torch.empty(2048, 512, dtype=torch.bfloat16)
        with OpFlops(cost) as mm:
            a @ b  # compute-bound: 2 * 1024 * 2048 * 512 FLOPs
        with OpFlops(cost) as add:
            a + a  # memory-bound: two inputs read, one output written, 4 MiB each
        with OpFlops(cost) as view:
            a.view(2048, 1024).t()
    assert mm.seconds == pytest.approx(LAUNCH + 2 * 1024 * 2048 * 512 / (H100.half_flops * ROOFLINE_MATMUL), rel=1e-12)
    assert add.seconds == pytest.approx(LAUNCH + 3 * 1024 * 2048 * 2 / (H100.bandwidth * ROOFLINE_MEMORY), rel=1e-12)
    assert view.seconds == 0.0
    # fp32 runs on the FP32 peak, not the tensor cores
    assert roofline(H100, None).per_flop == pytest.approx(1 / (H100.fp32_flops * ROOFLINE_MATMUL))


def test_a_float8_matmul_runs_at_twice_the_bf16_peak_on_a_card_that_has_them():
    """``_scaled_mm`` (--float8) at the float8 tensor cores' rate on Hopper; an A100 has none (and --float8 is refused
    there), so its roofline keeps one rate."""
    with fake_mode():
        a = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn)
        b = torch.empty(4096, 4096, dtype=torch.float8_e4m3fn).t()  # column-major, as _scaled_mm takes it; compute-bound
        one = torch.ones(())
        with OpFlops(roofline(H100, torch.bfloat16)) as fp8:
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    flops = 2 * 4096**3
    assert fp8.seconds == pytest.approx(LAUNCH + flops / (2 * H100.half_flops * ROOFLINE_MATMUL), rel=1e-12)
    assert roofline(GPUS["a100-80gb"], torch.bfloat16).per_fp8_flop is None


def test_rates_are_fitted_exactly_through_ops_of_known_cost():
    """Ops timed at two sizes with seconds = fixed + rate * work are fitted back to that fixed cost and rate;
    small ops take the pooled rate of their kind; the unexplained wall time is a cost per op."""
    def run(scale):  # (key, kind, work, seconds)
        mm = [("aten.mm", "flops", w * scale, 2e-6 + 1e-11 * w * scale) for w in (1 << 24, 1 << 26)]
        add = [("aten.add", "bytes", w * scale, 1e-6 + 1e-10 * w * scale) for w in (1 << 18, 1 << 20)]
        tiny = [("aten.ne", "bytes", 4, 3e-6)]
        return mm + add + tiny

    runs = [[run(1)] * 3, [run(2)] * 3]
    explained = sum(op[3] for op in run(2))
    rates = _fit_rates(runs, [explained + 5 * 5e-6] * 3)  # five ops, 5 us each unexplained
    assert rates.per_unit["aten.mm"] == pytest.approx(1e-11) and rates.fixed["aten.mm"] == pytest.approx(2e-6)
    assert rates.per_unit["aten.add"] == pytest.approx(1e-10) and rates.fixed["aten.add"] == pytest.approx(1e-6)
    assert rates.overhead == pytest.approx(5e-6)
    pooled = rates.default_per_byte
    assert rates.per_unit["aten.ne"] == pooled and rates.fixed["aten.ne"] == pytest.approx(3e-6 - 4 * pooled)
    assert _line([(8, 1.0)], 0.0, 1) == (0.0, 1.0 / 8)  # one large size: all rate


@pytest.fixture(scope="module")
def h100_profile(tiny_model_config):
    """A deterministic time model (the H100's roofline) on the tiny test model, profiled on fake tensors."""
    cfg = tiny_model_config()
    return cfg, profile_model(cfg, 4, 32, fake=True, cost=roofline(H100, None))


@pytest.mark.parametrize("plan", [Plan.uniform(4, o, h) for o in BLOCK_OPTIONS for h in HEAD_OPTIONS]
                         + [Plan(("none", "block", "pointwise", "selective"), "chunked")])
def test_predicted_step_time_is_the_cost_of_the_real_steps_ops(h100_profile, plan):
    """A plan's time composed from the profile's segments equals the same cost model summed over the ops of a
    real training step under that plan: the segments cut the step without losing or counting an op twice."""
    cfg, profile = h100_profile
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    idx = torch.randint(0, cfg.vocab_size, (4, 33))
    batches = [(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())]
    train_step(model, optimizer, batches, grad_clip=1.0)  # the optimizer state exists, as in the profile's steady step
    apply_activation_checkpointing(model, plan.spec())
    with OpFlops(roofline(H100, None)) as clock:
        train_step(model, optimizer, batches, grad_clip=1.0)
    remove_activation_checkpointing(model)
    assert predict(profile, plan).step_time == pytest.approx(clock.seconds, rel=0.01)


def test_the_solver_minimises_predicted_time_and_equals_exhaustive_search(h100_profile):
    _, p = h100_profile
    none = predict(p, Plan.uniform(4, "none"))
    lowest = min(predict(p, Plan(o, h)).peak for o in itertools.product(BLOCK_OPTIONS, repeat=4) for h in HEAD_OPTIONS)
    plans = set()
    for k in range(13):
        budget = lowest + (none.peak - lowest) * k // 12
        plan, pred = solve(p, budget)
        best_plan, best = solve_exhaustive(p, budget)
        assert pred.peak <= budget and pred.step_time == pytest.approx(best.step_time, rel=1e-12), (plan, best_plan)
        plans.add(plan.spec())
    assert len(plans) >= 4 and "none" in plans


def test_time_decides_where_flops_would_not():
    """When recomputing a block is slow for what it saves, the plan with more FLOPs but less time wins."""
    p = _two_option_profile(full_time=1.0, selective_time=3.0)
    plan, pred = solve(p, budget=p.baseline + 150)
    assert plan.blocks == ("block", "none") and pred.step_time == pytest.approx(1.0 + 1.0)
    p = _two_option_profile(full_time=3.0, selective_time=1.0)
    assert solve(p, budget=p.baseline + 150)[0].blocks == ("selective", "none")


def _two_option_profile(full_time: float, selective_time: float):
    """Two blocks, each saving 100 bytes unless recomputed; only one of them may keep its bytes."""
    from fitgpt.estimate.profile import BlockOption, HeadOption, StepProfile

    opts = {"none": BlockOption(100, 0, 0, 0, time=1.0), "pointwise": BlockOption(100, 0, 0, 0, time=1.0),
            "selective": BlockOption(40, 0, 0, 10, time=selective_time), "block": BlockOption(10, 0, 0, 50, time=full_time)}
    head = HeadOption(0, 0, 0, 0, 0)
    return StepProfile(batch_size=1, context=1, grad_accum=1, persistent_grads=False, device="cpu", params=0, optimizer=0,
                       grads=0, baseline=1000, embed_saved=0, embed_fwd_rise=0, embed_bwd_rise=0, embed_bwd_delta=0,
                       optimizer_rise=0, blocks=[opts, opts], block_grads=[0, 0], heads={"plain": head, "chunked": head},
                       block_flops=[100, 100], block_param_bytes=0, step_flops=200)


def test_plans_name_pointwise_and_map_any_policy():
    assert Plan(("pointwise", "none", "pointwise", "block")).spec() == "blocks:3+pointwise:0,2"
    assert Plan.uniform(3, "pointwise", "chunked").spec() == "pointwise+chunked-loss"
    assert Plan.from_policy("every:2+pointwise:1+chunked-loss", 4) == (Plan(("block", "pointwise", "block", "none"), "chunked"), True)
    assert Plan.from_policy("group:2", 4) == (Plan.uniform(4, "block"), False)


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_offload_is_a_costed_option_for_cuda_targets(tiny_model_config):
    """On a CUDA target a block may keep its activations in pinned host memory: nothing saved on the card, all of
    it back for its backward, each byte over the host link twice; the solver weighs it like any option."""
    from fitgpt.estimate.hardware import Target

    cfg = tiny_model_config()
    p = profile_model(cfg, 4, 32, fake=True, target=Target("cuda", H100), cost=roofline(H100, torch.bfloat16),
                      dtype=torch.bfloat16)
    none, off = p.blocks[0]["none"], p.blocks[0]["offload"]
    assert off.saved == 0 and off.bwd_rise == none.bwd_rise + none.saved and off.recompute_flops == 0
    assert off.time == pytest.approx(none.time + 2 * none.saved / H100.pcie)
    assert Plan.uniform(4, "offload").spec() == "offload"
    assert Plan.from_policy("offload:1+blocks:0", 4) == (Plan(("block", "offload", "none", "none")), True)
    cpu = profile_model(cfg, 4, 32, fake=True)
    assert "offload" not in cpu.blocks[0]  # on CPU activations already live in host memory
    none_peak = predict(p, Plan.uniform(4, "none")).peak
    for budget in (none_peak - 1, none_peak - none.saved):
        plan, pred = solve(p, budget)
        _, best = solve_exhaustive(p, budget)
        assert pred.step_time == pytest.approx(best.step_time, rel=1e-12)

