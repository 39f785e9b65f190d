"""Pure bf16 weights (issue 44, item 1): 2 bytes a weight and a gradient, each update computed in fp32 and rounded
stochastically (seeded, saved), planned to the byte, resumed bitwise. bf16 matmuls are about 40x slower than fp32 on
this CPU (no bf16 instructions), so every model here is tiny."""

import pytest
import torch
from safetensors.torch import load_file
from test_plan import Measured

from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.estimate.profile import profile_model
from fitgpt.optim import build_optimizer
from fitgpt.optim.bf16_weights import COMPENSATION, ROUNDED, Bf16Weights, round_stochastic
from fitgpt.plan import Plan, predict
from fitgpt.train.trainer import train

TINY = {"n_embed": 32, "n_head": 4, "n_blocks": 2, "context_length": 16, "dropout": 0.0, "weights_dtype": "bf16"}


def test_stochastic_rounding_is_unbiased_lands_on_a_neighbour_and_is_seeded():
    x = torch.full((100_000,), 1.0 + 3 * 2**-10)  # between bf16's 1.0 and 1.0078125, a quarter of the way... and more
    lo, hi = torch.tensor(1.0), torch.tensor(1.0 + 2**-7)
    r = round_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(r.unique().tolist()) == {lo.item(), hi.item()}
    assert r.mean().item() == pytest.approx(x[0].item(), abs=2e-5)  # 3/8 of them up: unbiased
    again = round_stochastic(x, torch.Generator().manual_seed(0))
    assert torch.equal(r.to(torch.bfloat16), again)
    exact = torch.tensor([1.0, -2.5, 0.0, 3.140625])  # already bf16 values: unchanged
    assert torch.equal(round_stochastic(exact, torch.Generator()).float(), exact)


def test_updates_under_half_a_bf16_step_are_kept_stochastically_and_lost_to_nearest():
    """SGD of 1e-3 a step on weights of 1.0 (bf16's step there: 2^-7, half of it 3.9e-3): to nearest nothing moves;
    stochastically the weights end where fp32 does, on average."""
    ends, opts = {}, {}
    for name, seed in (("nearest", None), ("stochastic", 0), ("kahan", None)):
        p = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opts[name] = Bf16Weights([{"params": [p]}], lambda g: torch.optim.SGD(g, lr=1e-3), seed, kahan=name == "kahan")
        for _ in range(100):
            p.grad = torch.ones_like(p)
            opts[name].step()
        ends[name] = p.float()
    assert torch.all(ends["nearest"] == 1.0)
    assert ends["stochastic"].mean().item() == pytest.approx(0.9, abs=2e-3)
    # Compensated: every weight is the bf16 nearest 0.9 (0.8984375), what it lacks kept in its bf16 compensation (to
    # 1e-4 in all: the compensation's own rounding, against nearest's 0.1).
    assert torch.all(ends["kahan"] == 0.8984375)
    (state,) = opts["kahan"].state.values()
    lost = state[COMPENSATION]
    assert lost.dtype == torch.bfloat16 and (ends["kahan"] + lost.float() - 0.9).abs().max() < 1e-4
    q = torch.nn.Parameter(ends["kahan"].to(torch.bfloat16))
    loaded = Bf16Weights([{"params": [q]}], lambda g: torch.optim.SGD(g, lr=1e-3), None, kahan=True)
    loaded.load_state_dict(opts["kahan"].state_dict())  # optimizers load state in the parameter's dtype: bf16 again
    assert torch.equal(loaded.state[q][COMPENSATION], lost)


SETTINGS = {
    "adamw": OptimConfig(grad_clip=0),
    "adamw, nearest": OptimConfig(grad_clip=0, rounding="nearest"),
    "adamw, kahan": OptimConfig(grad_clip=0, rounding="kahan"),
    "adafactor+in-backward": OptimConfig(grad_clip=0, name="adafactor", in_backward=True),
    "adamw, clipped, in-backward": OptimConfig(in_backward=True),
}


@pytest.mark.parametrize("name", [n if n.startswith("adamw") and "in-backward" not in n else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SETTINGS])
def test_bf16_weights_are_planned_to_the_byte(tiny_model_config, name):
    """The fake-tensor plan of a bf16-weight model and its optimizer (each parameter's fp32 stand-in, the rounding's
    random bits) against a real step's peak."""
    cfg = tiny_model_config(**TINY)
    optim = SETTINGS[name]
    profile = profile_model(cfg, 2, 16, "cpu", optim, fake=True)
    measured = Measured(cfg, batch=2, context=16, optim=optim)
    assert all(p.dtype == torch.bfloat16 for p in measured.model.parameters())
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert measured.peak(plan) == predict(profile, plan).peak, (name, option)


def test_bf16_weights_hold_about_two_bytes_a_parameter_with_adafactor_in_the_backward(tiny_model_config):
    cfg = tiny_model_config(**{**TINY, "n_embed": 64, "vocab_size": 256})
    pred = predict(profile_model(cfg, 1, 16, "cpu", SETTINGS["adafactor+in-backward"], fake=True),
                   Plan.uniform(cfg.n_blocks, "none"))
    n = sum(p.numel() for p in Measured(cfg, batch=1, context=16, optim=SETTINGS["adafactor+in-backward"]).model.parameters())
    assert 2.0 < (pred.params + pred.grads + pred.optimizer) / n < 2.5  # weights 2, the factors, the largest gradient


@pytest.mark.slow
@pytest.mark.parametrize("optim", [{}, {"name": "adafactor", "in_backward": True, "grad_clip": 0.0},
                                   {"rounding": "kahan", "in_backward": True, "grad_clip": 0.0}])
def test_a_bf16_weight_run_resumes_bitwise_with_its_rounding_generator(make_cfg, tmp_path, optim):
    """Each parameter's count of stochastic roundings (its bits drawn from the seed, its place and that count), or
    Kahan's compensations (bf16 again once loaded), saved and resumed."""
    kw = {"max_steps": 4, "checkpoint_interval": 2, "model": TINY, "optim": optim, "batch_size": 2}
    run = tmp_path / "run"
    train(make_cfg(run, **kw))
    state = torch.load(run / "checkpoints/step_00000002/state.pt", weights_only=True)["optimizer"]
    if optim.get("rounding") == "kahan":
        assert all(s[COMPENSATION].dtype == torch.bfloat16 for s in state["state"].values())
    else:
        assert all(s[ROUNDED] == 2 for s in state["state"].values())
    first = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in first.values())
    train(make_cfg(run, resume=str(run / "checkpoints/step_00000002"), **kw))
    again = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
    assert all(torch.equal(first[k], again[k]) for k in first)


def test_what_bf16_weights_cannot_do_is_refused_naming_the_flag(make_cfg, tmp_path):
    for kw, flag in (({"precision": "fp16"}, "--precision"), ({"optim": {"offload": True}}, "--optim.offload")):
        with pytest.raises(UserError, match=flag):
            make_cfg(tmp_path / "r", model=TINY, **kw)
    with pytest.raises(UserError, match="add --model.weights-dtype bf16, or drop --optim.rounding"):
        make_cfg(tmp_path / "r", optim={"rounding": "kahan"})  # fp32 weights: nothing to round
    assert isinstance(build_optimizer(torch.nn.Linear(2, 2), OptimConfig(), torch.device("cpu")), torch.optim.AdamW)


def test_muon_over_bf16_weights_steps_the_hidden_matrices_with_muon():
    """Muon over pure bf16 weights stepped every parameter with AdamW: the fp32 stand-ins were not the matrices Muon
    was given, so none was Muon's. Now each stand-in is sorted by the parameter it stands for."""
    from fitgpt.model import ModelConfig, Transformer
    from fitgpt.optim.muon import MuonAdamW

    model = Transformer(ModelConfig(**TINY))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    opt = build_optimizer(model, OptimConfig(name="muon"), torch.device("cpu"))
    assert isinstance(opt.inner, MuonAdamW)
    muon = opt.inner.parts[0]
    assert isinstance(muon, torch.optim.Muon)
    assert sum(len(g["params"]) for g in muon.param_groups) == 4 * model.config.n_blocks  # qkv, proj, fc, proj


def test_stochastic_rounding_draws_alike_for_a_parameter_whoever_steps_it():
    """A parameter's n-th rounding draws from (seed, its place, n), not from a stream the parameters before it drew
    from: stepped by an optimizer of its own that numbers it as one over every parameter does, it rounds to the same
    bits (what lets the rank that owns a parameter round it as one process would)."""
    torch.manual_seed(0)
    first, second = (torch.nn.Parameter(torch.randn(64, 64).to(torch.bfloat16)) for _ in range(2))
    again = torch.nn.Parameter(second.detach().clone())

    def adamw(groups):
        return torch.optim.AdamW(groups, lr=1e-3)

    every = Bf16Weights([{"params": [first, second]}], adamw, seed=3, numbering={id(first): 0, id(second): 1})
    alone = Bf16Weights([{"params": [again]}], adamw, seed=3, numbering={id(again): 1})
    for _ in range(3):
        for p in (first, second, again):
            p.grad = torch.full_like(p, 1e-3)
        every.step()
        alone.step()
    assert torch.equal(second, again) and alone.state[again][ROUNDED] == 3
