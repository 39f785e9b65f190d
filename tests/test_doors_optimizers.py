"""The careless day at the doors of the new optimizers, weights and meshes (issue 59): a resume that changes the
optimizer, a projection rank the model cannot have, planning a step that branches on its data, a plan the trainer
would refuse, and a dependency that reaches for the network. Each test failed on the code before its fix."""

import subprocess
import sys

import pytest
import torch
from hang import guard
from test_doors import one_line, run_cli

from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.estimate.timing import _median_run
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer, describe_optimizer
from fitgpt.refusals import IN_BACKWARD_DDP
from fitgpt.train.dist_checkpoint import load_optimizer
from fitgpt.train.distributed import DistInfo
from fitgpt.train.trainer import train

CPU = torch.device("cpu")


def _run_files(run) -> dict:
    return {p.relative_to(run): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file() and p.name != ".lock"}


@pytest.mark.parametrize("was,asks", [({"name": "adamw"}, {"name": "muon"}),
                                      ({"name": "adafactor", "lr": 3e-2}, {"name": "adamw"}),
                                      ({"name": "galore-adamw", "rank": 8}, {"name": "galore-adamw", "rank": 4})])
def test_a_resume_that_changes_the_optimizers_form_is_refused_naming_both_and_touching_nothing(make_cfg, tmp_path, was, asks):
    """adamw -> muon trained on, Muon stepping over AdamW's moments, the log naming Muon; adafactor -> adamw ended in a
    KeyError inside the optimizer; a GaLore rank changed, in a size mismatch. Now one line names both settings."""
    run = tmp_path / "run"
    train(make_cfg(run, optim=was, max_steps=2, checkpoint_interval=2))
    before = _run_files(run)
    key = "name" if was["name"] != asks["name"] else "rank"
    with pytest.raises(UserError, match=rf"--optim.{key} {was[key]} \(this run asks for {asks[key]}\)"):
        train(make_cfg(run, optim=asks, max_steps=4, resume="latest"))
    assert _run_files(run) == before


def test_adamws_moments_read_into_one_another_on_resume(make_cfg, tmp_path):
    """fp32, bf16 and 8-bit moments are one form (8-bit checkpoints plain moments): a resume may change between them."""
    run = tmp_path / "run"
    train(make_cfg(run, optim={"name": "adamw8bit"}, max_steps=2, checkpoint_interval=2))
    assert train(make_cfg(run, optim={"state_dtype": "bf16"}, max_steps=4, resume="latest"))["steps"] == 4


def test_a_resumed_optimizer_steps_with_the_settings_it_was_built_with():
    """Loading a state dict restores the saved groups' settings: a resume with --optim.weight-decay 0.5 logged 0.5
    and stepped with the checkpoint's 0.1 (and its betas). The state is the checkpoint's, the settings this run's."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(context_length=8, n_embed=16, n_head=2, n_blocks=1, vocab_size=64))
    saved_with = build_optimizer(model, OptimConfig(weight_decay=0.1), CPU)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    saved_with.step()
    saved = saved_with.state_dict()
    asked = OptimConfig(weight_decay=0.5, beta2=0.99)
    resumed = build_optimizer(model, asked, CPU)
    load_optimizer(resumed, saved, DistInfo())
    assert resumed.param_groups[0]["weight_decay"] == 0.5 and resumed.param_groups[1]["weight_decay"] == 0.0
    assert all(g["betas"] == (0.9, 0.99) for g in resumed.param_groups)
    for p in model.parameters():
        assert torch.equal(resumed.state[p]["exp_avg_sq"], saved_with.state[p]["exp_avg_sq"])


def test_a_projection_rank_above_every_matrix_is_refused_before_anything_is_written(make_cfg, tmp_path):
    """rank 64 over matrices 32 wide trained in silence, logging a rank no matrix had."""
    run = tmp_path / "run"
    with pytest.raises(UserError, match=r"--optim.rank 64: .* at most 32 .* use --optim.rank 32 or less"):
        train(make_cfg(run, optim={"name": "galore-adamw", "rank": 64}))
    assert not (run / "config.json").exists()


def test_the_methods_own_rank_is_capped_at_the_models_and_logged_as_used():
    """APOLLO's own rank, 256, over a model 32 wide: logged as 256, a rank no matrix has; now the rank it projects."""
    model = Transformer(ModelConfig(context_length=8, n_embed=32, n_head=2, n_blocks=1, vocab_size=64))
    assert "rank 32," in describe_optimizer(OptimConfig(name="apollo"), CPU, model)
    optimizer = build_optimizer(model, OptimConfig(name="apollo"), CPU)
    assert {g["rank"] for g in optimizer.param_groups if "rank" in g} == {32}


def test_plan_refuses_a_projection_rank_the_model_cannot_have(capsys):
    code, err = run_cli(["plan", "--memory-budget", "1GiB", "--optim.name", "galore-adamw", "--optim.rank", "512"], capsys)
    assert code == 2 and one_line(err) and "--optim.rank 512" in err and "at most 128" in err


def test_calibration_costs_the_step_a_data_dependent_optimizer_takes_most_often():
    """APOLLO-Mini's norm limiter takes a branch on the data: the repeats ran other ops, and calibration stopped with a
    traceback. Now an op counts where at least half the repeats ran it, at its median time."""
    a, b, c = ("mm", "flops", 100, 1.0), ("add", "bytes", 8, 2.0), ("mul", "bytes", 8, 5.0)
    runs = [[a, b], [a, b, c], [(*a[:3], 3.0), b], [a, b, c]]
    assert _median_run(runs) == [("mm", "flops", 100, 1.0), ("add", "bytes", 8, 2.0), ("mul", "bytes", 8, 5.0)]
    assert _median_run(runs[:3]) == [("mm", "flops", 100, 1.0), ("add", "bytes", 8, 2.0)]
    twice = [[a, a, b], [a, b]]  # the second mm of its size is the second op of its kind, counted apart
    assert _median_run(twice) == [("mm", "flops", 100, 1.0), ("mm", "flops", 100, 1.0), ("add", "bytes", 8, 2.0)]


@pytest.mark.slow
def test_apollo_mini_is_planned_for_this_cpu(capsys):
    code, err = run_cli(["plan", "--memory-budget", "200MiB", "--optim.name", "apollo-mini", "--batch-size", "2",
                         "--context", "32"], capsys)
    assert code == 0, err


@pytest.mark.parametrize("command", [["plan", "--memory-budget", "200MiB"], ["fit", "--memory-budget", "200MiB"]])
def test_plan_and_fit_refuse_what_every_rank_would_refuse_in_the_trainers_words(command, capsys):
    """plan --world-size 2 printed a torchrun command that every rank refused; fit printed its tables, then a traceback."""
    code, err = run_cli([*command, "--world-size", "2", "--optim.in-backward", "--optim.grad-clip", "0"], capsys)
    assert code == 2 and one_line(err) and IN_BACKWARD_DDP in err, err


@pytest.mark.slow
def test_the_projection_libraries_are_imported_without_reaching_for_a_model_hub():
    """bitsandbytes, which GaLore and APOLLO import, fetched a CPU kernel from a hub at import (where the CPU has
    AVX-512 bf16, as this one): offline, a warning about a publisher's trust, and seconds lost."""
    code = ("import sys; from fitgpt.optim.lowrank import _library; _library('galore-adamw'); _library('apollo'); "
            "print('kernels' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=guard(120))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False" and "kernels-community" not in out.stderr


def test_fsdp_offload_with_a_whole_matrix_step_is_refused_naming_the_flag():
    """Every optimizer now trains under FSDP, each matrix gathered whole to its owner; FSDP's host offload keeps the
    shards where the cards' collectives cannot gather them: one line, before anything runs."""
    from fitgpt.config import load_config
    from fitgpt.refusals import launch_refusal

    cfg = load_config("tiny", overrides={"parallel": "fsdp", "fsdp_offload": True, "optim": {"name": "muon"}})
    why = launch_refusal(cfg, 2, "cuda", None)
    assert why and "--fsdp-offload" in why and "--optim.name muon" in why and "\n" not in why
    assert launch_refusal(load_config("tiny", overrides={"parallel": "fsdp", "fsdp_offload": True}), 2, "cuda", None) is None
