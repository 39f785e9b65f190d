"""The fastest whole configuration (`fitgpt fit`'s second half and `fitgpt train --auto-config`): micro-batch x
accumulation, precision, DDP/FSDP and offload, each with its fastest plan, ranked by predicted time."""

import dataclasses
import json

import pytest

from fitgpt.cli import main
from fitgpt.cli.workload import BudgetConfig
from fitgpt.plan import PlanError, predict, solve
from fitgpt.plan.fastest import Layout, _link_seconds, fastest


@pytest.mark.slow
def test_fastest_configuration_on_a_card(tmp_path):
    """Every configuration shown fits on a profile of its own size, fastest first; a budget too small for the
    whole batch at once is met by accumulating smaller micro-batches."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"vocab_size": 128, "context_length": 64, "n_embed": 64, "n_head": 4, "n_blocks": 4},
                               "batch_size": 8, "grad_accum": 2}))
    flags = BudgetConfig(config=str(cfg), gpu="t4", memory_budget="20MiB")
    w = flags.workload
    result = fastest(w, flags.budget, top=4)
    choices = result["choices"]
    assert choices and all(c.settled and c.peak <= flags.budget for c in choices)
    assert [c.tokens_per_s for c in choices] == sorted((c.tokens_per_s for c in choices), reverse=True)
    assert all(c.micro_batch * c.grad_accum == 16 and c.tokens == 16 * 64 for c in choices)
    best = choices[0]
    exact = w.vary(batch_size=best.micro_batch, grad_accum=best.grad_accum, precision=best.precision).profile()
    assert predict(exact, best.plan).peak == best.peak
    whole = w.vary(batch_size=16, grad_accum=1, precision="fp16").profile()
    with pytest.raises(PlanError):
        solve(whole, flags.budget)  # the whole batch at once does not fit: every answer accumulates
    assert all(c.grad_accum > 1 for c in choices)


@pytest.mark.slow
def test_auto_config_trains_the_fastest_configuration(tmp_path, capsys, cli_train_args):
    """What fit prints is tested in test_plan.py (test_fit_command); --auto-config trains its fastest choice and
    records the choice, not the request, in config.json."""
    run = tmp_path / "run"
    args = cli_train_args(run, steps=2) + ["--auto-config", "--memory-budget", "30MiB", "--precision", "fp32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "auto-config: micro-batch" in out
    saved = json.loads((run / "config.json").read_text())
    assert saved["batch_size"] * saved["grad_accum"] == 4 and saved["auto_config"] is False
    assert saved["activation_checkpointing"] != "auto" and saved["memory_budget"] is None


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_auto_config_errors_name_what_to_change(tmp_path, capsys, cli_train_args, monkeypatch):
    assert main(cli_train_args(tmp_path / "a") + ["--auto-config"]) == 2
    assert "--memory-budget" in capsys.readouterr().err
    # 256 KiB: the model planned at the data's vocabulary (512) fits in 1 MiB (the preset's 2048 did not)
    assert main(cli_train_args(tmp_path / "b") + ["--auto-config", "--memory-budget", "256KiB", "--precision", "fp32"]) == 2
    assert "no configuration of 128 tokens a step fits --memory-budget 256KiB" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(cli_train_args(tmp_path / "c") + ["--auto-config", "--memory-budget", "1GiB"]) == 2
    assert "fitgpt fit --world-size N" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert main(cli_train_args(tmp_path / "d") + ["--fsdp-offload"]) == 2
    assert "--parallel fsdp" in capsys.readouterr().err


@pytest.mark.slow
def test_fastest_configuration_weighs_ddp_fsdp_and_offload_for_several_cards(tmp_path):
    """With --world-size the search puts DDP, FSDP and FSDP with CPU offload side by side; where the weights and
    AdamW state alone exceed a card only sharding or offload fit, and links are costed for what crosses them."""

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"model": {"vocab_size": 512, "context_length": 64, "n_embed": 128, "n_head": 4, "n_blocks": 4},
                               "batch_size": 4, "grad_accum": 1}))
    # The budget less two cuBLAS workspaces (16.25 MiB on an A100) leaves 12.75 MiB for the step's tensors: DDP's
    # 13.9 MB of weights, gradients and AdamW state per rank alone exceed it; FSDP's shards leave room, and so do
    # tensor parallelism's halves (the tied embedding and head split once, as Megatron does)
    flags = BudgetConfig(config=str(cfg), gpu="a100-80gb", world_size=2, memory_budget="29MiB", precision="bf16")
    w = flags.workload
    layouts = {c.layout.name for c in fastest(w, flags.budget, top=6)["choices"]}
    assert layouts == {"fsdp", "tp2"}
    # 3.75 MiB: nothing fits unless parameters, gradients and optimizer state leave the card
    flags = dataclasses.replace(flags, memory_budget="20MiB")
    layouts = {c.layout.name for c in fastest(w, flags.budget, top=6)["choices"]}
    assert layouts == {"fsdp+offload"}
    # DDP's all-reduce: 2 (n-1)/n of the fp32 gradients over NVLink, less what the last backward hides
    params = 10**6
    assert _link_seconds(w, Layout("ddp"), 1, 0.0, params, 2, 4) == pytest.approx(2 * 0.5 * 4 * params / 300e9)
    assert _link_seconds(w, Layout("ddp"), 1, 1.0, params, 2, 4) == 0.0
    # FSDP, every micro-batch: two bf16 gathers and an fp32 reduce-scatter of (n-1)/n of the weights
    assert _link_seconds(w, Layout("fsdp"), 2, 0.0, params, 2, 4) == pytest.approx(0.5 * params * 2 * (2 * 2 + 4) / 300e9)
    off = _link_seconds(w, Layout("fsdp", True), 2, 1.0, params, 2, 4)
    assert off == pytest.approx(6 * 4 * params / 2 / 32e9)  # the shard in twice a micro-batch, its gradients out once
    # Tensor parallelism over both ranks, every micro-batch: each of the 4 blocks' 8 collectives moves (t-1)/t of a
    # (4, 64, 128) bf16 activation, not hidden; no data-parallel traffic
    tp = _link_seconds(w, Layout("tp", tp=2), 2, 1.0, params, 2, 4)
    assert tp == pytest.approx(8 * 4 * 0.5 * 4 * 64 * 128 * 2 * 2 / 300e9)
