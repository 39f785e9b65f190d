"""The planner: predictions against measured peaks, the solver against exhaustive search, the commands."""

import itertools

import pytest
import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.bench.report import pareto_front
from fitgpt.config import OptimConfig, load_config
from fitgpt.device import autocast
from fitgpt.errors import UserError
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.profile import BLOCK_OPTIONS, HEAD_OPTIONS, fixed_costs, profile_model
from fitgpt.estimate.roofline import roofline
from fitgpt.memory.timeline import measure_train_step
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.plan import Plan, PlanError, min_peak, predict, solve, solve_exhaustive
from fitgpt.plan.extrapolate import extrapolate
from fitgpt.units import format_bytes, parse_bytes

B, T = 4, 32
MIXED = [
    Plan(("none", "block", "selective", "block")),
    Plan(("block", "none", "none", "selective"), "chunked"),
    Plan(("selective", "selective", "block", "none"), "chunked"),
    Plan(("pointwise", "none", "selective", "block"), "fused"),
]


class Measured:
    """One model and optimizer in the trainer's steady state; measures the real peak of any plan."""

    def __init__(self, cfg, batch=B, context=T, grad_accum=1, dtype=None, optim=None):
        torch.manual_seed(0)
        self.model = Transformer(cfg)
        self.opt = build_optimizer(self.model, optim or OptimConfig(), torch.device("cpu"))
        idx = torch.randint(0, cfg.vocab_size, (grad_accum, batch, context + 1), generator=torch.Generator().manual_seed(1))
        self.batches = [(idx[i, :, :-1].contiguous(), idx[i, :, 1:].contiguous()) for i in range(grad_accum)]
        # Clipped as the optimizer config given says (the profile clips as its optim config does).
        self.step_kw = {"amp": autocast(torch.device("cpu"), dtype), "grad_clip": optim.grad_clip if optim else 0.0}
        measure_train_step(self.model, self.opt, self.batches, **self.step_kw)  # the optimizer state exists from here on
        self._cache: dict[str, int] = {}

    def peak(self, plan: Plan) -> int:
        if plan.spec() not in self._cache:
            apply_activation_checkpointing(self.model, plan.spec())
            try:
                self._cache[plan.spec()] = measure_train_step(self.model, self.opt, self.batches, **self.step_kw).peak
            finally:
                remove_activation_checkpointing(self.model)
        return self._cache[plan.spec()]


@pytest.fixture(scope="module")
def tiny_profile(tiny_model_config):
    return profile_model(tiny_model_config(), B, T)


@pytest.fixture(scope="module")
def tiny_measured(tiny_model_config):
    return Measured(tiny_model_config())


def uniform_plans(n):
    return [Plan.uniform(n, o, h) for o in BLOCK_OPTIONS for h in HEAD_OPTIONS]


def test_predicted_peak_matches_measured_for_uniform_and_mixed_plans(tiny_profile, tiny_measured):
    for plan in uniform_plans(4) + MIXED:
        pred, real = predict(tiny_profile, plan).peak, tiny_measured.peak(plan)
        assert abs(real - pred) <= 0.01 * real, (plan.spec(), pred, real)


@pytest.mark.parametrize("grad_accum", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_prediction_holds_with_gradient_accumulation(tiny_model_config, grad_accum):
    """To the byte: the gradients held between micro-batches, and the loss the earlier ones add up (one fp32 total)."""
    cfg = tiny_model_config()
    profile = profile_model(cfg, B, T, grad_accum=grad_accum, fake=True)
    measured = Measured(cfg, grad_accum=grad_accum)
    for plan in [Plan.uniform(4, "none"), Plan.uniform(4, "block", "chunked"), MIXED[0]]:
        assert predict(profile, plan).peak == measured.peak(plan), plan.spec()


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_prediction_holds_under_bf16_autocast(tiny_model_config):
    """Autocast caches a bf16 copy of each weight until the forward ends: a recomputed block does not keep
    it for backward (it was counted as kept, over-predicting full plans by about 4%)."""
    cfg = tiny_model_config()
    profile = profile_model(cfg, B, T, dtype=torch.bfloat16)
    # Under none only the bias copies are transient (addmm does not save its bias); under full, every copy.
    assert profile.blocks[0]["block"].transient > 20 * profile.blocks[0]["none"].transient > 0
    measured = Measured(cfg, dtype=torch.bfloat16)
    for plan in uniform_plans(4) + MIXED:
        pred, real = predict(profile, plan).peak, measured.peak(plan)
        assert abs(real - pred) <= 0.002 * real, (plan.spec(), pred, real)


def test_dynamic_programme_equals_exhaustive_search_with_transient_bytes(tiny_model_config):
    profile = profile_model(tiny_model_config(), B, T, dtype=torch.bfloat16)
    none = predict(profile, Plan.uniform(4, "none")).peak
    lowest = min_peak(profile)[1].peak
    for k in range(11):
        budget = lowest + (none - lowest) * k // 10
        best = solve_exhaustive(profile, budget)
        plan, pred = solve(profile, budget)
        assert best is not None and pred.peak <= budget
        assert pred.recompute_flops == best[1].recompute_flops, (budget, plan.spec(), best[0].spec())


@pytest.mark.parametrize("preset,batch,context", [("tiny", 4, 64), pytest.param("small", 1, 64, marks=pytest.mark.slow)])
def test_presets_measured_within_ten_percent_of_prediction(preset, batch, context):
    """The issue's honesty target, on the presets themselves (small at a CPU-sized batch)."""
    cfg = load_config(preset).model
    profile = profile_model(cfg, batch, context)
    measured = Measured(cfg, batch, context)
    none = predict(profile, Plan.uniform(cfg.n_blocks, "none"))
    lowest = min_peak(profile)[1].peak
    with pytest.raises(PlanError):
        solve(profile, lowest - 1)
    # Budgets inside the range plans can reach (on small at batch 1 the weights leave little room above the lowest).
    for frac in (0.5, 0.25):
        budget = lowest + int(frac * (none.peak - lowest))
        plan, pred = solve(profile, budget)
        real = measured.peak(plan)
        assert abs(real - pred.peak) <= 0.10 * pred.peak, (plan.spec(), pred.peak, real)
        assert real <= budget * 1.01


def test_dynamic_programme_equals_exhaustive_search(tiny_profile):
    none = predict(tiny_profile, Plan.uniform(4, "none")).peak
    lowest = min(predict(tiny_profile, p).peak for p in itertools.starmap(Plan, itertools.product(
        itertools.product(BLOCK_OPTIONS, repeat=4), HEAD_OPTIONS)))
    plans = set()
    for k in range(21):
        budget = lowest + (none - lowest) * k // 20
        best = solve_exhaustive(tiny_profile, budget)
        plan, pred = solve(tiny_profile, budget)
        assert best is not None and pred.peak <= budget
        assert pred.recompute_flops == best[1].recompute_flops, (budget, plan.spec(), best[0].spec())
        plans.add(plan.spec())
    # The budgets span from the lowest peak to none's: the comparison covered many different plans, not one.
    assert len(plans) >= 5 and "none" in plans
    with pytest.raises(PlanError):
        solve(tiny_profile, lowest - 1)


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_blocks_alike_get_their_options_in_runs(tiny_model_config):
    """A deep model's middle blocks cost alike: which of them recompute is a tie, broken the same way every time (whole
    nanoseconds, not float sums in different orders), so that the plan keeps runs of alike blocks, which the allocator
    replay deepens from a shallow step. Float sums gave 6-9 runs at these budgets."""
    h100 = find_gpu("h100-80gb")
    cfg = tiny_model_config(arch="llama", n_blocks=24, n_embed=256, n_head=4, n_kv_head=2, ffn_hidden=512, vocab_size=512,
                            context_length=256)
    p = profile_model(cfg, 4, 256, fake=True, target=Target("cuda", h100), dtype=torch.bfloat16,
                      cost=roofline(h100, torch.bfloat16))
    none, low = (predict(p, Plan.uniform(p.n_blocks, o)).peak for o in ("none", "block"))
    for between in (0.3, 0.5, 0.7):
        plan, _ = solve(p, int(low + between * (none - low)))
        assert sum(1 for i in range(p.n_blocks) if i == 0 or plan.blocks[i] != plan.blocks[i - 1]) <= 3, plan.spec()


def test_a_budget_with_room_to_spare_needs_no_search_over_plans(tiny_profile, monkeypatch):
    """Where every block's cheapest option fits, that plan is the answer, found in one prediction. fit --gpu
    a100-80gb on the tiny preset probed depths up to 1024 blocks, each a search over plans whose fronts grow with the
    depth: over five minutes, now seconds."""
    import fitgpt.plan.solver as solver
    from fitgpt.plan.largest import _largest

    deep = tiny_profile.with_blocks(1024)
    none = predict(deep, Plan.uniform(1024, "none")).peak
    monkeypatch.setattr(solver, "_solve_head", lambda *a: pytest.fail("searched over plans"))
    plan, pred = solve(deep, none)
    assert plan == Plan.uniform(1024, "none") and pred.peak == none
    assert _largest(tiny_profile.with_blocks, "auto", none, 1, 1024) == 1024


@pytest.fixture(scope="module")
def long_context(tiny_model_config):
    """A long context for the width, so that 25% of none's activations still leaves a plan that fits."""
    cfg = tiny_model_config(context_length=128)
    return profile_model(cfg, B, 128), Measured(cfg, B, 128)


@pytest.mark.parametrize("frac", [0.5, 0.25])
def test_auto_within_two_percent_of_measured_exhaustive_optimum(long_context, frac):
    """Against every one of the 4^4 x 3 plans, measured in order of their (exact) FLOPs until one truly fits: auto's
    FLOPs are within 2% of the best that truly fits."""
    tiny_profile, tiny_measured = long_context
    none = predict(tiny_profile, Plan.uniform(4, "none"))
    budget = none.peak - int((1 - frac) * none.activations_end_of_forward)
    plan, pred = solve(tiny_profile, budget)
    assert tiny_measured.peak(plan) <= budget
    plans = sorted((Plan(opts, head) for opts in itertools.product(BLOCK_OPTIONS, repeat=4) for head in HEAD_OPTIONS),
                   key=lambda p: predict(tiny_profile, p).recompute_flops)
    # Measured only where predicted within 1% of the budget: predictions are within 0.2% of real steps (tested
    # above), so a plan predicted further over cannot truly fit, and measuring each such plan took most of the time.
    best = next(predict(tiny_profile, p).recompute_flops + tiny_profile.step_flops for p in plans
                if predict(tiny_profile, p).peak <= 1.01 * budget and tiny_measured.peak(p) <= budget)
    assert pred.recompute_flops + tiny_profile.step_flops <= best * 1.02
    # and no fixed policy that fits does better
    for fixed in uniform_plans(4):
        if tiny_measured.peak(fixed) <= budget:
            assert pred.recompute_flops <= predict(tiny_profile, fixed).recompute_flops


def test_plan_spec_round_trips_through_the_policy_grammar(tiny_model_config):
    assert Plan.uniform(4, "none").spec() == "none"
    assert Plan.uniform(4, "block", "chunked").spec() == "block+chunked-loss"
    assert Plan(("block", "none", "selective", "block")).spec() == "blocks:0,3+selective:2"
    model = Transformer(tiny_model_config())
    for plan in MIXED:
        apply_activation_checkpointing(model, plan.spec())  # the grammar accepts every plan the solver writes


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_under_fsdp_the_no_fit_message_asks_for_more_ranks_not_for_fsdp(tiny_model_config):
    profile = profile_model(tiny_model_config(), 2, 32, "cpu", fake=True, fsdp_ranks=2)
    with pytest.raises(PlanError, match="shard them over more than 2 GPUs \\(--world-size\\)"):
        solve(profile, profile.params)  # the shards of weights, gradients and AdamW state alone exceed it


def test_no_fit_messages_say_by_how_much_and_what_to_change(tiny_profile):
    with pytest.raises(PlanError, match=r"alone take .*--model.n-blocks") as e:
        solve(tiny_profile, tiny_profile.params)
    assert "no checkpointing can help" in str(e.value)
    lowest = min(predict(tiny_profile, p).peak for p in uniform_plans(4))
    with pytest.raises(PlanError, match=r"over .*--batch-size \d+.*--context \d+") as e:
        solve(tiny_profile, lowest - 1024)
    assert "most aggressive plan" in str(e.value)


def test_batch_extrapolation_matches_a_real_profile(tiny_model_config):
    cfg = tiny_model_config()
    points = [(b, profile_model(cfg, b, T)) for b in (1, 2)]
    real = profile_model(cfg, 6, T)
    guess = extrapolate(points, 6, "batch_size")
    for plan in uniform_plans(4) + MIXED:
        a, b = predict(guess, plan).peak, predict(real, plan).peak
        assert abs(a - b) <= 0.02 * b, plan.spec()


def test_more_blocks_scale_the_fixed_costs(tiny_profile, tiny_model_config):
    deeper = tiny_profile.with_blocks(8)
    assert deeper.n_blocks == 8
    real = profile_model(tiny_model_config(n_blocks=8), B, T)
    for plan in (Plan.uniform(8, "none"), Plan.uniform(8, "block", "chunked")):
        a, b = predict(deeper, plan).peak, predict(real, plan).peak
        assert abs(a - b) <= 0.02 * b


@pytest.mark.parametrize("optim, accum, gpu, fsdp", [
    ({}, 1, None, 1),
    pytest.param({"in_backward": True, "state_dtype": "bf16"}, 1, "h100-80gb", 1, marks=pytest.mark.slow),
    pytest.param({"name": "adamw8bit", "in_backward": True}, 1, None, 1, marks=pytest.mark.slow),
    pytest.param({"in_backward": True, "state_dtype": "bf16", "grad_clip": 0.0}, 1, None, 2, marks=pytest.mark.slow),
    pytest.param({"name": "adafactor"}, 2, None, 1, marks=pytest.mark.slow),
    pytest.param({}, 1, None, 2, marks=pytest.mark.slow),
])
def test_the_fixed_costs_alone_are_the_profiles(optim, accum, gpu, fsdp, tiny_model_config):
    """What `fit` checks its budget against before searching (no step profiled) is what a profile counts, and the
    optimizer's step: a step in the backward is measured on its first step, the others on their second."""
    cfg, o = tiny_model_config(), OptimConfig(**optim)
    target = Target("cuda", find_gpu(gpu)) if gpu else None
    kw = {"optim_cfg": o, "grad_accum": accum, "target": target, "fsdp_ranks": fsdp, "dtype": torch.bfloat16 if gpu else None}
    fixed, p = fixed_costs(cfg, **kw), profile_model(cfg, 2, 16, fake=True, **kw)
    assert (fixed["params"], fixed["grads"], fixed["optimizer"]) == (p.params, p.grads, p.optimizer)
    assert fixed["optimizer_rise"] == p.optimizer_rise
    assert fixed["optimizer"] > 0 and fixed["grads"] > 0


def test_parse_bytes():
    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("6GB") == 6 * 10**9
    assert parse_bytes("1.5g") == int(1.5 * 2**30)
    assert parse_bytes("512") == 512
    assert format_bytes(3 * 2**20) == "3.0 MiB"
    for bad in ("six gigs", "-1GiB", "0", "5XB", ""):
        with pytest.raises(UserError, match="--memory-budget"):
            parse_bytes(bad)


def test_pareto_front():
    pts = [(1.0, 10.0), (2.0, 5.0), (3.0, 6.0), (1.5, 10.0), (4.0, 1.0)]
    assert pareto_front(pts) == [0, 1, 4]


@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
def test_the_optimizer_implementation_is_a_setting_training_and_planning_share(impl, tiny_model_config):
    """fused, foreach and for-loop AdamW hold different temporaries while they step: the plan profiles the one the
    trainer builds (optim.impl), and a real step's peak is the predicted one, byte for byte, under none and block."""
    optim = OptimConfig(impl=impl)
    cfg = tiny_model_config()
    opt = build_optimizer(Transformer(cfg), optim, torch.device("cpu"))
    assert (opt.defaults["fused"], opt.defaults["foreach"]) == (impl == "fused", impl == "foreach")
    profile = profile_model(cfg, B, T, "cpu", optim, fake=True)
    measured = Measured(cfg, optim=optim)
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert measured.peak(plan) == predict(profile, plan).peak, (impl, option)
