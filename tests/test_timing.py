"""The time model: per-op costs, their sum over a profile's segments, the fastest plan, the fastest configuration."""

import dataclasses
import itertools
import json

import pytest
import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.cli import main
from fitgpt.config import OptimConfig
from fitgpt.memory.fake import fake_mode
from fitgpt.memory.flops import OpFlops
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.plan import Plan, PlanError, predict, profile_model, solve, solve_exhaustive
from fitgpt.plan.profile import BLOCK_OPTIONS, HEAD_OPTIONS
from fitgpt.plan.search import fastest
from fitgpt.plan.target import GPUS
from fitgpt.plan.timing import LAUNCH, ROOFLINE_MATMUL, ROOFLINE_MEMORY, _fit_rates, _line, roofline
from fitgpt.plan.workload import BudgetConfig
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
                         + [Plan(("none", "full", "pointwise", "selective"), "chunked")])
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
    assert plan.blocks == ("full", "none") and pred.step_time == pytest.approx(1.0 + 1.0)
    p = _two_option_profile(full_time=3.0, selective_time=1.0)
    assert solve(p, budget=p.baseline + 150)[0].blocks == ("selective", "none")


def _two_option_profile(full_time: float, selective_time: float):
    """Two blocks, each saving 100 bytes unless recomputed; only one of them may keep its bytes."""
    from fitgpt.plan.profile import BlockOption, HeadOption, StepProfile

    opts = {"none": BlockOption(100, 0, 0, 0, time=1.0), "pointwise": BlockOption(100, 0, 0, 0, time=1.0),
            "selective": BlockOption(40, 0, 0, 10, time=selective_time), "full": BlockOption(10, 0, 0, 50, time=full_time)}
    head = HeadOption(0, 0, 0, 0, 0)
    return StepProfile(batch_size=1, context=1, grad_accum=1, persistent_grads=False, device="cpu", params=0, optimizer=0,
                       grads=0, baseline=1000, embed_saved=0, embed_fwd_rise=0, embed_bwd_rise=0, embed_bwd_delta=0,
                       optimizer_rise=0, blocks=[opts, opts], block_grads=[0, 0], heads={"plain": head, "chunked": head},
                       block_flops=[100, 100], block_param_bytes=0, step_flops=200)


def test_plans_name_pointwise_and_map_any_policy():
    assert Plan(("pointwise", "none", "pointwise", "full")).spec() == "blocks:3+pointwise:0,2"
    assert Plan.uniform(3, "pointwise", "chunked").spec() == "pointwise+chunked-loss"
    assert Plan.from_policy("every:2+pointwise:1+chunked-loss", 4) == (Plan(("full", "pointwise", "full", "none"), "chunked"), True)
    assert Plan.from_policy("group:2", 4) == (Plan.uniform(4, "full"), False)


def test_fastest_configuration_on_a_card(tmp_path):
    """Every configuration shown fits on a profile of its own size, fastest first; a budget too small for the
    whole batch at once is met by accumulating smaller micro-batches."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"vocab_size": 128, "context_length": 64, "n_embed": 64, "n_head": 4, "n_blocks": 4},
                               "batch_size": 8, "grad_accum": 2}))
    w = BudgetConfig(config=str(cfg), gpu="t4", memory_budget="20MiB")
    result = fastest(w, w.budget, top=4)
    choices = result["choices"]
    assert choices and all(c.settled and c.peak <= w.budget for c in choices)
    assert [c.tokens_per_s for c in choices] == sorted((c.tokens_per_s for c in choices), reverse=True)
    assert all(c.micro_batch * c.grad_accum == 16 and c.tokens == 16 * 64 for c in choices)
    best = choices[0]
    exact = dataclasses.replace(w, batch_size=best.micro_batch, grad_accum=best.grad_accum, precision=best.precision).profile()
    assert predict(exact, best.plan).peak == best.peak
    whole = dataclasses.replace(w, batch_size=16, grad_accum=1, precision="fp16").profile()
    with pytest.raises(PlanError):
        solve(whole, w.budget)  # the whole batch at once does not fit: every answer accumulates
    assert all(c.grad_accum > 1 for c in choices)


def test_fit_prints_the_fastest_configurations_and_train_runs_one(tmp_path, capsys, cli_train_args):
    assert main(["fit", "--batch-size", "4", "--context", "32", "--memory-budget", "40MiB", "--top", "3", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    fast = json.loads(out.strip().splitlines()[-1])["fastest"]
    assert 1 <= len(fast) <= 3 and "train the fastest: fitgpt train" in out
    run = tmp_path / "run"
    args = cli_train_args(run, steps=2) + ["--auto-config", "--memory-budget", "30MiB", "--precision", "fp32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "auto-config: micro-batch" in out
    saved = json.loads((run / "config.json").read_text())
    assert saved["batch_size"] * saved["grad_accum"] == 4 and saved["auto_config"] is False
    assert saved["activation_checkpointing"] != "auto" and saved["memory_budget"] is None


def test_auto_config_errors_name_what_to_change(tmp_path, capsys, cli_train_args, monkeypatch):
    assert main(cli_train_args(tmp_path / "a") + ["--auto-config"]) == 2
    assert "--memory-budget" in capsys.readouterr().err
    assert main(cli_train_args(tmp_path / "b") + ["--auto-config", "--memory-budget", "1MiB", "--precision", "fp32"]) == 2
    assert "no configuration of 128 tokens a step fits --memory-budget 1MiB" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(cli_train_args(tmp_path / "c") + ["--auto-config", "--memory-budget", "1GiB"]) == 2
    assert "fitgpt fit --world-size N" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert main(cli_train_args(tmp_path / "d") + ["--fsdp-offload"]) == 2
    assert "--parallel fsdp" in capsys.readouterr().err


def test_offload_is_a_costed_option_for_cuda_targets(tiny_model_config):
    """On a CUDA target a block may keep its activations in pinned host memory: nothing saved on the card, all of
    it back for its backward, each byte over the host link twice; the solver weighs it like any option."""
    from fitgpt.plan.target import Target

    cfg = tiny_model_config()
    p = profile_model(cfg, 4, 32, fake=True, target=Target("cuda", H100), cost=roofline(H100, torch.bfloat16),
                      dtype=torch.bfloat16)
    none, off = p.blocks[0]["none"], p.blocks[0]["offload"]
    assert off.saved == 0 and off.bwd_rise == none.bwd_rise + none.saved and off.recompute_flops == 0
    assert off.time == pytest.approx(none.time + 2 * none.saved / H100.pcie)
    assert Plan.uniform(4, "offload").spec() == "offload"
    assert Plan.from_policy("offload:1+blocks:0", 4) == (Plan(("full", "offload", "none", "none")), True)
    cpu = profile_model(cfg, 4, 32, fake=True)
    assert "offload" not in cpu.blocks[0]  # on CPU activations already live in host memory
    none_peak = predict(p, Plan.uniform(4, "none")).peak
    for budget in (none_peak - 1, none_peak - none.saved):
        plan, pred = solve(p, budget)
        _, best = solve_exhaustive(p, budget)
        assert pred.step_time == pytest.approx(best.step_time, rel=1e-12)


def test_fastest_configuration_weighs_ddp_fsdp_and_offload_for_several_cards(tmp_path):
    """With --world-size the search puts DDP, FSDP and FSDP with CPU offload side by side; where the weights and
    AdamW state alone exceed a card only sharding or offload fit, and links are costed for what crosses them."""
    from fitgpt.plan.search import Layout, _link_seconds

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"vocab_size": 512, "context_length": 64, "n_embed": 128, "n_head": 4, "n_blocks": 4},
                               "batch_size": 4, "grad_accum": 1}))
    # The budget less two cuBLAS workspaces (16.25 MiB on an A100) leaves 12.75 MiB for the step's tensors: DDP's
    # 13.9 MB of weights, gradients and AdamW state per rank alone exceed it; FSDP's shards leave room.
    w = BudgetConfig(config=str(cfg), gpu="a100-80gb", world_size=2, memory_budget="29MiB", precision="bf16")
    layouts = {c.layout.name for c in fastest(w, w.budget, top=6)["choices"]}
    assert layouts == {"fsdp"}
    # 3.75 MiB: nothing fits unless parameters, gradients and optimizer state leave the card
    w = dataclasses.replace(w, memory_budget="20MiB")
    layouts = {c.layout.name for c in fastest(w, w.budget, top=6)["choices"]}
    assert layouts == {"fsdp+offload"}
    # DDP's all-reduce: 2 (n-1)/n of the fp32 gradients over NVLink, less what the last backward hides
    params = 10**6
    assert _link_seconds(w, Layout("ddp"), 1, 0.0, params, 2) == pytest.approx(2 * 0.5 * 4 * params / 300e9)
    assert _link_seconds(w, Layout("ddp"), 1, 1.0, params, 2) == 0.0
    off = _link_seconds(w, Layout("fsdp", True), 2, 1.0, params, 2)
    assert off == pytest.approx(5 * 4 * params / 2 / 32e9)  # the shard in twice a micro-batch, gradients out once
