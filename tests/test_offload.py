"""The optimizer on the host (--optim.offload): bitwise the weights of the step on the card, loading a plain state,
planned to the byte, refused where it cannot run, resumed from and into a plain run, bounded by the host's memory
(moved from test_optim.py, issue 47: files under 400 lines)."""

import copy
import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from test_optim import CPU, _steps
from test_plan import Measured

from fitgpt.cli import main
from fitgpt.config import OptimConfig, load_config
from fitgpt.errors import UserError
from fitgpt.estimate.profile import profile_model
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer, set_lr
from fitgpt.plan import Plan, predict
from fitgpt.step import train_step
from fitgpt.train.trainer import train


@pytest.mark.parametrize("policy, clip, free_grads, accum", [("none", 0.0, False, 1), ("block", 0.05, False, 2),
                                                              ("none", 0.05, True, 1), ("block", 0.0, True, 1)])
def test_the_optimizer_on_the_host_gives_bitwise_the_weights_of_the_step_on_the_card(tiny_model_config, policy, clip,
                                                                                       free_grads, accum):
    """CPU fp32, dropout on: the host's copies step as the card's parameters would, bit for bit (fused AdamW both);
    clipping scales the gradients the host steps (a clip of the card's copies would be lost: the norm and weights
    would differ); accumulation copies the summed gradient; with free_grads no gradient is left on the card."""
    from fitgpt.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    card = Transformer(tiny_model_config(n_embed=64, dropout=0.1))
    host = copy.deepcopy(card)
    for m in (card, host):
        apply_activation_checkpointing(m, policy)
    opt_card = build_optimizer(card, OptimConfig(grad_clip=clip, impl="fused"), CPU)
    opt_host = build_optimizer(host, OptimConfig(grad_clip=clip, impl="fused", offload=True, in_backward=free_grads), CPU)
    big = {p for p in host.parameters() if p.numel() >= 4096}  # matrices offloaded, vectors kept on the card
    assert set(opt_host.twin) == big and len(opt_host.card_optimizer.param_groups[1]["params"]) > 0
    results = {}
    for name, model, opt in (("card", card, opt_card), ("host", host, opt_host)):
        torch.manual_seed(5)
        g = torch.Generator().manual_seed(1)
        results[name] = []
        for s in range(3):
            idx = torch.randint(0, 128, (accum, 4, 17), generator=g)
            set_lr(opt, 1e-3 * (s + 1))
            results[name].append(train_step(model, opt, [(i[:, :-1], i[:, 1:]) for i in idx], grad_clip=clip))
    if clip:
        assert min(float(r.grad_norm) for r in results["card"]) > clip  # the clip acted
    for key in ("loss", "grad_norm"):
        assert [float(getattr(r, key)) for r in results["card"]] == [float(getattr(r, key)) for r in results["host"]]
    for a, b in zip(card.state_dict().values(), host.state_dict().values()):
        assert torch.equal(a, b)
    sa, sh = opt_card.state_dict(), opt_host.state_dict()
    assert [g["params"] for g in sa["param_groups"]] == [g["params"] for g in sh["param_groups"]]
    assert sa["state"].keys() == sh["state"].keys()
    assert all(torch.equal(sa["state"][i][k], sh["state"][i][k]) for i in sa["state"] for k in sa["state"][i])


def test_the_optimizer_on_the_host_loads_a_plain_state_and_continues_bitwise(tiny_model_config):
    """Two steps on the card, its state dict loaded into an optimizer on the host (the host copies taken from the
    weights as loaded), two more: the weights of four on the card. And the host's state dict back into a plain one."""
    torch.manual_seed(0)
    straight = Transformer(tiny_model_config(n_embed=64))
    other = copy.deepcopy(straight)
    cfg = OptimConfig(grad_clip=0.05, impl="fused")
    opt = build_optimizer(straight, cfg, CPU)
    _steps(straight, opt, n=4, grad_clip=0.05)
    for first, second in ((cfg, dataclasses.replace(cfg, offload=True)), (dataclasses.replace(cfg, offload=True), cfg)):
        model = copy.deepcopy(other)
        a = build_optimizer(model, first, CPU)
        _steps(model, a, n=2, grad_clip=0.05)
        resumed = copy.deepcopy(model)
        b = build_optimizer(resumed, second, CPU)
        b.load_state_dict(copy.deepcopy(a.state_dict()))
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            torch.randint(0, 128, (4, 17), generator=g)  # the batches already taken
        for s in range(2, 4):
            idx = torch.randint(0, 128, (4, 17), generator=g)
            set_lr(b, 1e-3 * (s + 1))
            train_step(resumed, b, [(idx[:, :-1], idx[:, 1:])], grad_clip=0.05)
        for x, y in zip(straight.state_dict().values(), resumed.state_dict().values()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("name", ["offload", pytest.param("offload+in-backward", marks=pytest.mark.slow)])
def test_the_optimizer_on_the_host_is_planned_to_the_byte(tiny_model_config, name):
    """On the card: the weights, the gradients unless freed once copied, and only the small parameters' state; on the
    host 16 bytes an offloaded parameter (its copy, its gradient, two moments) and the step counts. The planner runs
    the host on the meta device; a real CPU step (fused AdamW, no temporaries) peaks exactly as predicted."""
    cfg = tiny_model_config(n_blocks=6, n_embed=64)
    optim = OptimConfig(grad_clip=0.05, impl="fused", offload=True, in_backward=name.endswith("in-backward"))
    profile = profile_model(cfg, 2, 16, "cpu", optim, fake=True)
    measured = Measured(cfg, batch=2, context=16, optim=optim)
    big = [p for p in measured.model.parameters() if p.numel() >= 4096]
    assert profile.host == 16 * sum(p.numel() for p in big) + 4 * len(big) == measured.opt.host_bytes()
    small = [p for p in measured.model.parameters() if p.numel() < 4096]
    assert profile.optimizer == 8 * sum(p.numel() for p in small) + 4 * len(small)
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert measured.peak(plan) == predict(profile, plan).peak, (name, option)


@pytest.mark.parametrize("overrides, flag", [
    ({"optim": {"offload": True, "name": "adamw8bit"}}, "use --optim.name adamw with --optim.offload"),
    ({"optim": {"offload": True}, "precision": "fp16"}, "--precision bf16"),
    ({"optim": {"offload": True}, "parallel": "fsdp", "fsdp_offload": True}, "keep one of them"),
    ({"optim": {"offload": True, "in_backward": True}, "grad_accum": 2}, "--grad-accum 1"),
])
def test_what_the_optimizer_on_the_host_cannot_do_is_refused_naming_the_flag(overrides, flag):
    with pytest.raises(UserError, match=flag):
        load_config("tiny", overrides=overrides)
    if "in_backward" in overrides["optim"]:  # the update is applied after the backward: a bad step can be skipped
        load_config("tiny", overrides={"optim": {"offload": True, "in_backward": True}, "max_bad_steps": 3})


def test_the_optimizer_on_the_host_needs_a_cuda_card(make_cfg, tmp_path, capsys):
    with pytest.raises(UserError, match="this runs on cpu, which holds it already: drop --optim.offload"):
        train(make_cfg(tmp_path / "run", optim={"offload": True}))
    assert not (tmp_path / "run").exists()
    for flags in (["--optim.offload"], ["--optim.offload", "--gpu", "rtx-4090", "--world-size", "2"]):
        assert main(["plan", "--preset", "tiny", *flags]) == 2
        err = capsys.readouterr().err
        assert "--optim.offload" in err and len(err.strip().splitlines()) == 1


def test_training_with_the_optimizer_on_the_host_resumes_from_and_into_a_plain_run(make_cfg, tmp_path, monkeypatch):
    """Through the trainer (the CUDA check lifted: on the CPU the host's copies are plain copies): the weights of the
    plain run, bit for bit, clipping on; each run's checkpoint resumes under the other setting."""
    import fitgpt.refusals as refusals

    monkeypatch.setattr(refusals, "offload_refusal", lambda device_type: None)
    model = {"context_length": 32, "n_embed": 64, "n_head": 4, "n_blocks": 2, "dropout": 0.0}
    kw = {"max_steps": 4, "checkpoint_interval": 2, "model": model}
    runs = {}
    for name, optim in (("plain", {"impl": "fused"}), ("host", {"impl": "fused", "offload": True})):
        train(make_cfg(tmp_path / name, optim=optim, **kw))
        runs[name] = load_file(str(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors"))
    for k in runs["plain"]:
        assert torch.equal(runs["plain"][k], runs["host"][k]), k
    for name, optim in (("plain", {"impl": "fused", "offload": True}), ("host", {"impl": "fused"})):
        train(make_cfg(tmp_path / name, optim=optim, resume=str(tmp_path / name / "checkpoints" / "step_00000002"), **kw))
        again = load_file(str(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors"))
        for k in runs["plain"]:
            assert torch.equal(runs["plain"][k], again[k]), (name, k)


@pytest.mark.slow
def test_the_host_bounds_what_the_optimizer_on_the_host_trains(capsys):
    """What the optimizer on the host pins is bounded by --host-memory: the largest model on the host rung pins no more,
    one block deeper would; a plan over it gives no train command."""
    from fitgpt.cli.workload import BudgetConfig
    from fitgpt.plan.family import ON_THE_HOST, largest_model, scaled

    flags = BudgetConfig(preset="tiny", batch_size=1, context=16, grad_accum=1, gpu="rtx-4090", memory_budget="1GiB",
                         host_memory="12MiB")
    (row,) = largest_model(flags.workload, flags.budget, ladder=(ON_THE_HOST,), host_budget=flags.host_budget)
    assert 0 < row.host <= flags.host_budget
    deeper = scaled(flags.workload.train.model, row.model.n_blocks + 1)
    assert flags.workload.vary(model=deeper, optim=row.optim, grad_accum=1).profile().host > flags.host_budget
    assert main(["plan", "--preset", "tiny", "--gpu", "rtx-4090", "--optim.offload", "--host-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "no train command: this plan does not fit the host's memory" in out
    assert json.loads(out.strip().splitlines()[-1])["fits_host"] is False
