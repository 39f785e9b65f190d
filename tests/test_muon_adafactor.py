"""Optimizers other than AdamW (issue 44, item 2). Muon: PyTorch's on the hidden matrices and
AdamW on the rest, as one optimizer: planned to the byte, checkpointed in the parameters' order, resumed bitwise,
after the backward or inside it. Adafactor: its factored moments checkpointed and resumed bitwise (planned to the
byte in test_optim.py, beside the other settings)."""

import pytest
import torch
from safetensors.torch import load_file
from test_plan import Measured

from fitgpt.config import OptimConfig
from fitgpt.estimate.profile import profile_model
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer, optimizer_params
from fitgpt.optim.muon import MuonAdamW, hidden_matrices
from fitgpt.plan import Plan, predict
from fitgpt.train.trainer import train

SETTINGS = {"muon": OptimConfig(name="muon"), "muon+in-backward": OptimConfig(name="muon", in_backward=True, grad_clip=0)}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_muon_steps_the_hidden_matrices_and_adamw_the_rest(tiny_model_config, arch):
    model = Transformer(tiny_model_config(arch=arch, n_blocks=2))
    hidden = hidden_matrices(model)
    assert all(p.dim() == 2 for p in hidden) and model.token_embed.weight not in hidden
    assert model.lm_head.weight not in hidden and len(hidden) == 4 * 2 + (3 * 2 if arch == "llama" else 0)
    opt = build_optimizer(model, SETTINGS["muon"], torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    assert all(set(opt.state[p]) == ({"momentum_buffer"} if p in hidden else {"step", "exp_avg", "exp_avg_sq"})
               for p in model.parameters())
    sd = opt.state_dict()  # one optimizer's, indexed in the parameters' order: a checkpoint reads it so
    order = optimizer_params(model)
    assert sorted(sd["state"]) == list(range(len(order)))
    assert all(sd["state"][i].get("momentum_buffer", sd["state"][i].get("exp_avg")).shape == p.shape for i, p in enumerate(order))


@pytest.mark.parametrize("name", list(SETTINGS))
def test_muon_is_planned_to_the_byte(tiny_model_config, name):
    cfg = tiny_model_config(n_blocks=2)
    profile = profile_model(cfg, 2, 16, "cpu", SETTINGS[name], fake=True)
    measured = Measured(cfg, batch=2, context=16, optim=SETTINGS[name])
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert measured.peak(plan) == predict(profile, plan).peak, (name, option)


@pytest.mark.parametrize("optim", [{"name": "muon"}, {"name": "muon", "in_backward": True, "grad_clip": 0.0}])
def test_a_muon_run_resumes_bitwise(resumes_bitwise, tmp_path, optim):
    resumes_bitwise(tmp_path / "run", optim=optim)


def test_adafactor_keeps_factored_moments_and_resumes_bitwise(make_cfg, tmp_path):
    """PyTorch's Adafactor: a row and a column per matrix in the checkpoint (loaded with weights_only, its shapes
    checked as factored), and a run resumed from step 2 ends bitwise where the uninterrupted one does, with the step
    after the backward or inside it."""
    model = {"context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.1}
    for optim in ({"name": "adafactor"}, {"name": "adafactor", "in_backward": True, "grad_clip": 0.0}):
        run = tmp_path / ("inside" if optim.get("in_backward") else "after")
        kw = {"max_steps": 4, "checkpoint_interval": 2, "model": model, "optim": optim}
        train(make_cfg(run, **kw))
        state = torch.load(run / "checkpoints/step_00000002/state.pt", weights_only=True)["optimizer"]["state"]
        assert {k: v.shape[1] for k, v in state[0].items() if k == "row_var"} == {"row_var": 1}
        first = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
        train(make_cfg(run, resume=str(run / "checkpoints/step_00000002"), **kw))
        again = load_file(str(run / "checkpoints/step_00000004/model.safetensors"))
        assert all(torch.equal(first[k], again[k]) for k in first), optim
