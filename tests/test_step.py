"""The one training step: the trainer trains with it, the profiler and bench measure it."""

import math

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_model
from torch.utils._python_dispatch import TorchDispatchMode

from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.device import autocast
from fitgpt.memory.timeline import PeakProbe, measure_train_step
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer, lr_at
from fitgpt.step import grad_scaler, train_step
from fitgpt.train.checkpoint import tied_names
from fitgpt.train.loop import TrainingError
from fitgpt.train.trainer import build_model, train


def test_the_trainer_step_is_the_shared_train_step(make_cfg, tmp_path):
    """Weights after two trainer steps equal two calls of ``train_step`` by hand, bit for bit (clipping, lr included)."""
    cfg = make_cfg(tmp_path / "run", max_steps=2, checkpoint_interval=2, grad_accum=2, **{"model": {
        "context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.0}})
    cfg.optim.grad_clip = 0.05  # small enough that clipping acts
    summary = train(cfg)
    trained = load_file(str(tmp_path / "run" / "checkpoints" / "step_00000002" / "model.safetensors"))

    data = TokenData(cfg.data.path)
    model = build_model(cfg, math.ceil(data.vocab_size / 64) * 64, torch.device("cpu"))  # seeded as the trainer seeds it
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    sampler = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed)
    norms = []
    for step in range(2):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg.optim, cfg.max_steps)
        batches = [sampler.next_batch(torch.device("cpu")) for _ in range(cfg.grad_accum)]
        result = train_step(model, opt, batches, grad_clip=cfg.optim.grad_clip)
        norms.append(float(result.grad_norm))
    assert bool(result.applied) and float(result.loss) == summary["train_loss"]
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
    assert not bool(result.applied) and math.isnan(float(result.loss))
    assert all(p.grad is None for p in model.parameters())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before if not torch.isnan(before[k]).any())
    assert not opt.state  # AdamW never stepped: no moments were created


def test_the_loss_scaler_runs_through_the_same_step(tiny_model_config):
    """A disabled scaler (fp32/bf16) and an enabled one (fp16's; by powers of two, exact in fp32) give the same
    weights as none: the step scales the loss, unscales before clipping, steps through the scaler. An overflowing
    scale makes the scaler skip the update and halve (routine under fp16: not a bad step for --max-bad-steps)."""
    x = torch.randint(0, 128, (2, 32))
    cpu = torch.device("cpu")
    scalers = {"none": None, "disabled": grad_scaler(cpu, torch.bfloat16), "enabled": torch.amp.GradScaler("cpu", init_scale=2.0**10),
               "overflow": torch.amp.GradScaler("cpu", init_scale=2.0**127)}
    assert not scalers["disabled"].is_enabled() and scalers["enabled"].is_enabled()
    results = {}
    for name, scaler in scalers.items():
        torch.manual_seed(0)
        model = Transformer(tiny_model_config())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = train_step(model, opt, [(x, x)], scaler=scaler, grad_clip=1.0)
        results[name] = model.state_dict()
    for name in ("disabled", "enabled"):
        assert all(torch.equal(results["none"][k], results[name][k]) for k in results["none"]), name
    assert scalers["enabled"].get_scale() == 2.0**10
    assert all(torch.equal(before[k], results["overflow"][k]) for k in before)  # skipped
    assert scalers["overflow"].get_scale() == 2.0**126 and result.applied.item() and not result.grad_norm.isfinite()


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


class _HostReads(TorchDispatchMode):
    """Counts reads of tensor values on the host (.item(), float(), bool()): each one waits for the device."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _Poisoned(torch.nn.Module):
    """The model, whose loss can be made NaN (and so every gradient)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.on = model, False

    def forward(self, x, y):
        logits, loss = self.model(x, y)
        return logits, loss * float("nan") if self.on else loss


def test_a_step_reads_nothing_on_the_host_and_skips_a_nan_step_on_the_device(tiny_model_config):
    model = _Poisoned(Transformer(tiny_model_config()))
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # skips on the device, as on CUDA
    x = torch.randint(0, 128, (2, 32))
    batches = [(x, x), (x, x)]
    with _HostReads() as reads:
        train_step(model, fused, batches, grad_clip=1.0)
    assert reads.count == 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: {n: v.clone() for n, v in s.items()} for k, s in zip(range(len(fused.state)), fused.state.values())}
    model.on = True
    with _HostReads() as reads:
        result = train_step(model, fused, batches, grad_clip=1.0)
    assert reads.count == 0
    assert not bool(result.applied) and math.isnan(float(result.loss))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # parameters untouched
    for k, s in zip(range(len(fused.state)), fused.state.values()):
        assert all(torch.equal(state[k][n], v) for n, v in s.items())  # moments and step counts too
    # An unfused optimizer decides on the host (and PyTorch's unfused AdamW reads its step counts):
    # a fixed number of reads per step, none per micro-batch.
    model.on = False
    unfused = torch.optim.AdamW(model.parameters(), lr=1e-3)
    counts = []
    for n in (1, 1, 3):
        with _HostReads() as reads:
            train_step(model, unfused, [(x, x)] * n, grad_clip=1.0)
        counts.append(reads.count)
    assert counts[1] == counts[2] > 0


def test_the_trainer_reports_a_skipped_step_at_its_next_read(make_cfg, tmp_path, nan_model):
    """Results are read every --log-interval steps: a NaN at step 0 stops the run at step 4's read, before
    the save at step 3 (checkpoints follow a read), naming step 0."""
    import pytest


    with pytest.raises(TrainingError, match=r"loss is nan at step 0 .*last good checkpoint: none"):
        train(make_cfg(tmp_path / "run", log_interval=4, eval_interval=5, checkpoint_interval=3))
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))
