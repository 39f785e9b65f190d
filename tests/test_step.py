"""The one training step: the trainer trains with it, the profiler and bench measure it."""

import math

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model

from fitgpt.data import BatchSampler, TokenData
from fitgpt.device import autocast
from fitgpt.memory.profile import PeakProbe, measure_train_step
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer, lr_at
from fitgpt.step import grad_scaler, train_step
from fitgpt.train import train
from fitgpt.train.checkpoint import tied_names


def test_the_trainer_step_is_the_shared_train_step(make_cfg, tmp_path):
    """Weights after two trainer steps equal two calls of ``train_step`` by hand, bit for bit (clipping, lr included)."""
    cfg = make_cfg(tmp_path / "run", max_steps=2, checkpoint_interval=2, grad_accum=2, **{"model": {
        "context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.0}})
    cfg.optim.grad_clip = 0.05  # small enough that clipping acts
    summary = train(cfg)
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors"))

    data = TokenData(cfg.data.path)
    torch.manual_seed(cfg.seed)
    vocab = math.ceil(data.vocab_size / 64) * 64
    model = Transformer(type(cfg.model)(**{**cfg.model.__dict__, "vocab_size": vocab}))
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    sampler = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed)
    norms = []
    for step in range(2):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optim, cfg.max_steps)
        batches = [sampler.next_batch(torch.device("cpu")) for _ in range(cfg.grad_accum)]
        result = train_step(model, opt, batches, grad_clip=cfg.optim.grad_clip)
        norms.append(result.grad_norm)
    assert result.applied and result.loss == summary["train_loss"]
    assert min(norms) > cfg.optim.grad_clip  # the clip really scaled the gradients
    by_hand = model.state_dict()
    assert trained.keys() == set(by_hand) - set(tied_names(by_hand))
    for name, t in trained.items():
        assert torch.equal(t, by_hand[name]), name


def test_a_non_finite_step_is_skipped_and_leaves_no_gradients(tiny_model_config):
    model = Transformer(tiny_model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (2, 32))
    with torch.no_grad():
        model.layer_norm.weight[0] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train_step(model, opt, [(x, x)], grad_clip=1.0)
    assert not result.applied and math.isnan(result.loss)
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not torch.isnan(before[k]).any())
    assert not opt.state  # AdamW never stepped: no moments were created


def test_fp16_scaler_runs_through_the_same_step(tiny_model_config):
    """A disabled scaler (fp32/bf16) gives the same weights as none; an enabled one scales and unscales."""
    x = torch.randint(0, 128, (2, 32))
    results = {}
    for name, scaler in {"none": None, "disabled": grad_scaler(torch.device("cpu"), torch.bfloat16)}.items():
        torch.manual_seed(0)
        model = Transformer(tiny_model_config())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        train_step(model, opt, [(x, x)], scaler=scaler, grad_clip=1.0)
        results[name] = model.state_dict()
    assert all(torch.equal(results["none"][k], results["disabled"][k]) for k in results["none"])


def test_measured_step_counts_clipping_and_amp_like_training(tiny_model_config):
    """measure_train_step takes the trainer's step options and measures them: bf16 autocast changes the peak."""
    torch.manual_seed(0)
    model = Transformer(tiny_model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (4, 32))
    train_step(model, opt, [(x, x)])
    fp32 = measure_train_step(model, opt, [(x, x)], grad_clip=1.0)
    bf16 = measure_train_step(model, opt, [(x, x)], grad_clip=1.0, amp=autocast(torch.device("cpu"), torch.bfloat16))
    assert fp32.source == bf16.source == "tracker"
    assert bf16.peak != fp32.peak
    with PeakProbe(model, opt) as probe:
        train_step(model, opt, [(x, x)], grad_clip=1.0)
    assert probe.result.peak == fp32.peak  # the same step measures the same bytes


def test_tied_names_match_what_save_model_writes(tiny_model_config, tmp_path):
    model = Transformer(tiny_model_config())
    save_model(model, str(tmp_path / "m.safetensors"))
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        written = set(f.keys())
    sd = model.state_dict()
    assert tied_names(sd) == ["token_embed.weight"]
    assert written == set(sd) - set(tied_names(sd))
