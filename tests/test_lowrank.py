"""GaLore and APOLLO (issue 44, item 2), wrapped from their authors' packages: the attention and MLP matrices
projected and nothing else, planned to the byte on the refresh step (the larger), checkpointed as tensors and
resumed bitwise, after the backward or inside it, over fp32 or bf16 weights; what cannot run is refused in one line."""

import dataclasses

import pytest
import torch
from test_plan import Measured

from fitgpt.cli import main
from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.estimate.profile import profile_model
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.optim.muon import hidden_matrices
from fitgpt.plan import Plan, predict
from fitgpt.train.trainer import train

NAMES = ["galore-adamw", "galore-adafactor", "apollo", "apollo-mini"]


def _opt(name, **kw):
    return OptimConfig(name=name, rank=4 if name != "adamw" else 0, **kw)


@pytest.mark.parametrize("name", NAMES)
def test_only_the_hidden_matrices_are_projected_and_the_state_is_low_rank(tiny_model_config, name):
    model = Transformer(tiny_model_config(n_blocks=2))
    opt = build_optimizer(model, _opt(name), torch.device("cpu"))
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    hidden = hidden_matrices(model)
    for p in model.parameters():
        state = opt.state[p]
        assert ("projector" in state) == (p in hidden), p.shape
        if p in hidden:  # a rank-4 projection: no state tensor as large as the matrix
            matrix = state["projector"].ortho_matrix
            assert 4 in matrix.shape and matrix.untyped_storage().nbytes() == matrix.numel() * 4
            assert all(4 in v.shape or v.dim() < 2 for v in state.values() if isinstance(v, torch.Tensor))


def test_galore_keeps_the_rank_rows_not_the_whole_svd_factor(tiny_model_config):
    """galore-torch's projector keeps ``Vh[:rank]``, a view holding the whole Vh (as large as a square matrix): the
    projection is kept as a copy of its own."""
    model = Transformer(tiny_model_config(n_blocks=1))
    opt = build_optimizer(model, _opt("galore-adamw"), torch.device("cpu"))
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    held = sum(s["projector"].ortho_matrix.untyped_storage().nbytes() for s in opt.state.values() if "projector" in s)
    assert held == sum(4 * 4 * min(p.shape) for p in hidden_matrices(model))


@pytest.mark.parametrize("name, in_backward", [("galore-adamw", False), ("apollo", False)] + [
    pytest.param(n, b, marks=pytest.mark.slow)
    for n, b in [("galore-adafactor", False), ("apollo-mini", False), *((n, True) for n in NAMES)]])
def test_planned_to_the_byte_on_the_refresh_step(tiny_model_config, name, in_backward):
    """The plan is the step that refreshes the projection (an SVD or a random draw: gap 1 refreshes every step),
    measured to the byte; an ordinary step (gap 1000) holds no more."""
    cfg = tiny_model_config(n_blocks=2)
    optim = _opt(name, update_proj_gap=1, in_backward=in_backward, grad_clip=0.0 if in_backward else 1.0)
    profile = profile_model(cfg, 2, 16, "cpu", optim, fake=True)
    refresh = Measured(cfg, batch=2, context=16, optim=optim)
    ordinary = Measured(cfg, batch=2, context=16, optim=dataclasses.replace(optim, update_proj_gap=1000))
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert refresh.peak(plan) == predict(profile, plan).peak, (name, option)
        assert ordinary.peak(plan) <= refresh.peak(plan)


@pytest.mark.parametrize("name, in_backward", [("galore-adamw", False), pytest.param("apollo", True, marks=pytest.mark.slow),
                                               pytest.param("adamw", True, marks=pytest.mark.slow)])
def test_a_deep_model_is_planned_as_every_block_profiled(tiny_model_config, monkeypatch, name, in_backward):
    """A deep model's optimizer step is profiled whole, apart from its blocks: each projection the refresh replaces
    is freed there (counted as held before), as the full profile sees it."""
    from test_fake import _fields

    from fitgpt.estimate import profile as prof

    cfg = tiny_model_config(n_blocks=prof.DEEP + 2, n_embed=40, n_head=5, vocab_size=200)
    optim = _opt(name, in_backward=in_backward, grad_clip=0.0)
    deep = profile_model(cfg, 3, 24, "cpu", optim, fake=True)
    monkeypatch.setattr(prof, "DEEP", 10**6)  # every block profiled
    assert _fields(deep) == _fields(profile_model(cfg, 3, 24, "cpu", optim, fake=True))


@pytest.mark.parametrize("name", NAMES)
def test_a_run_resumes_bitwise_with_its_projections(resumes_bitwise, tmp_path, name):
    """Resumed from step 2 of 4, a run ends bitwise where the uninterrupted one does: the projections (and APOLLO's
    seeds) come back from the checkpoint, refreshed every 3 steps so that one is carried across the resume."""
    resumes_bitwise(tmp_path / "run", optim={"name": name, "rank": 4, "update_proj_gap": 3})
    saved = torch.load(tmp_path / "run/checkpoints/step_00000002/state.pt", weights_only=True)["optimizer"]["state"]
    assert any("projection" in s for s in saved.values())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["galore-adamw", "apollo-mini"])
def test_in_the_backward_over_bf16_weights_resumes_bitwise(resumes_bitwise, tmp_path, name):
    optim = {"name": name, "rank": 4, "update_proj_gap": 3, "in_backward": True, "grad_clip": 0.0}
    model = {"context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.1, "weights_dtype": "bf16"}
    weights = resumes_bitwise(tmp_path / "run", optim=optim, model=model)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())


def test_stepping_in_the_backward_is_the_same_optimizer(tiny_model_config):
    """One optimizer per parameter (the step in the backward) draws APOLLO's projections as one over all of them
    does: the weights after three steps are equal."""
    weights = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = Transformer(tiny_model_config(n_blocks=2))
        opt = build_optimizer(model, _opt("apollo", update_proj_gap=2, in_backward=in_backward, grad_clip=0.0),
                              torch.device("cpu"))
        x = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
        weights.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights))


@pytest.mark.parametrize("argv, says", [
    (["plan", "--preset", "tiny", "--gpu", "rtx-4090", "--optim.name", "galore-adamw8bit"], "bitsandbytes' CUDA kernels"),
    (["plan", "--preset", "tiny", "--gpu", "rtx-4090", "--optim.rank", "8"], "setting of GaLore and APOLLO"),
    (["plan", "--preset", "tiny", "--gpu", "rtx-4090", "--optim.name", "apollo", "--optim.update-proj-gap", "-1"], "must not be negative"),
    (["plan", "--preset", "tiny", "--gpu", "rtx-4090", "--world-size", "2", "--parallel", "fsdp", "--optim.name",
      "galore-adamw8bit"], "bitsandbytes' CUDA kernels"),  # under FSDP too (GaLore itself once refused there)
])
def test_what_cannot_run_is_refused_in_one_line(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err


def test_galore_8bit_is_refused_on_the_cpu(make_cfg, tmp_path):
    with pytest.raises(UserError, match="run on CUDA only"):
        train(make_cfg(tmp_path / "run", optim={"name": "galore-adamw8bit"}))
