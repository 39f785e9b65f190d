import dataclasses
import json
import shlex
import subprocess
import sys

import pytest

from fitgpt.cli import main
from fitgpt.cli.train import parse
from fitgpt.config import TrainConfig, from_dict, load_config
from fitgpt.errors import UserError


@pytest.mark.parametrize("cmd", [[], ["prepare"], ["train"], ["generate"], ["bench"], ["plan"], ["fit"]])
def test_help_works(cmd, capsys):
    with pytest.raises(SystemExit) as e:
        main(cmd + ["--help"]) if cmd else sys.exit(main(["--help"]))
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage" in out.lower()


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "fitgpt", "train", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--activation-checkpointing" in out and "--checkpoint-interval" in out and "--model.n-embed" in out
    assert "--checkpointing" not in out.replace("--activation-checkpointing", "") and "--ckpt-interval" not in out


def test_precedence_defaults_preset_file_flags(tmp_path):
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"batch_size": 3, "model": {"n_blocks": 2}}))
    cfg = parse(["--preset", "small", "--config", str(cfg_file), "--model.n-blocks", "5", "--activation-checkpointing", "group:2"])
    assert cfg.model.n_embed == 768  # from the preset
    assert cfg.batch_size == 3  # from the file
    assert cfg.model.n_blocks == 5 and cfg.activation_checkpointing == "group:2"  # from flags


def test_old_spellings_are_refused_naming_the_key(tmp_path):
    """"checkpoint" means files on disk only: a config.json in the pre-release spellings names today's keys."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"checkpointing": "every:2"}))
    with pytest.raises(UserError, match="unknown key 'checkpointing'; valid keys here: .*activation_checkpointing"):
        load_config("tiny", str(old))


def test_saved_run_config_loads_back(tmp_path):
    from fitgpt.config import to_dict

    cfg = parse(["--max-steps", "7"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_dict(cfg)))
    assert parse(["--config", str(path)]) == dataclasses.replace(cfg, config=str(path))


@pytest.mark.parametrize(
    "data, match",
    [({"bogus": 1}, "unknown key 'bogus'"), ({"model": {"n_embd": 3}}, "unknown key 'model.n_embd'"),
     ({"batch_size": "8"}, "batch_size must be int"), ({"model": {"n_embed": 30, "n_head": 4}}, "n_head"),
     ({"optim": {"lr": -1.0}}, "optim.lr must be positive"), ({"batch_size": -2}, "--batch-size"),
     ({"precision": "fp8"}, "precision must be one of"), ({"activation_checkpointing": "group:x"}, "--activation-checkpointing"),
     ({"dist_stall_timeout": 2.0}, "--dist-stall-timeout")],
)
def test_config_errors_name_the_key(data, match):
    with pytest.raises(UserError, match=match):
        from_dict(TrainConfig, data, "test.json")


def test_cli_reports_user_errors_without_traceback(capsys):
    assert main(["train", "--preset", "huge"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset 'huge'" in err and "Traceback" not in err
    assert main(["train", "--preset", "huge", "--verbose"]) == 2  # the traceback behind the line, on request
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("error: unknown preset 'huge'; choose one of tiny, small, "
                                                        "medium, 3b, llama-tiny, llama-1b (--preset)")
    assert main(["frobnicate"]) == 2


@pytest.mark.parametrize("overrides", [
    {},
    {"batch_size": 3, "grad_accum": 2, "compile": True, "progress": False, "precision": "bf16"},
    {"model": {"context_length": 64, "bias": False, "n_blocks": 2}, "activation_checkpointing": "every:2+chunked-loss"},
    {"data": {"inputs": ["a b.txt", "c/*.jsonl"], "vocab_size": 4096}, "optim": {"lr": 1e-3}, "memory_budget": None},
])
def test_train_flags_give_the_config_back(overrides, tmp_path):
    from fitgpt.cli.train import parse
    from fitgpt.command import train_flags

    for preset, config in (("tiny", None), ("llama-tiny", None), ("tiny", tmp_path / "c.json")):
        if config:
            config.write_text(json.dumps({"model": {"arch": "llama", "n_blocks": 3, "n_embed": 96, "n_head": 6, "n_kv_head": 3}}))
        cfg = load_config(preset, str(config) if config else None, overrides=overrides)
        assert parse(train_flags(cfg)) == cfg, (preset, config, train_flags(cfg))


def _printed_command(out: str, prefix: str) -> list[str]:
    line = next(x for x in out.splitlines() if x.startswith(prefix))
    return shlex.split(line[len(prefix):].split("   (or:")[0])


@pytest.mark.slow
def test_the_printed_train_command_trains_what_was_planned(tmp_path, capsys):
    """plan's `train with:` and fit's `train the fastest:` parse back to the planned model and step: a config file's
    model (not the preset's), the context, batch and accumulation, the plan; torchrun for several ranks."""
    from fitgpt.cli.train import parse
    from fitgpt.cli.workload import BudgetConfig
    from fitgpt.command import train_command
    from fitgpt.plan.fastest import fastest, format_choices

    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({"model": {"arch": "llama", "n_blocks": 3, "n_embed": 64, "n_head": 4, "n_kv_head": 2,
                                              "vocab_size": 256}}))
    flags = ["--config", str(cfg_file), "--context", "48", "--batch-size", "3", "--grad-accum", "2"]
    assert main(["plan", *flags, "--memory-budget", "64MiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama, 3 blocks x 64 wide, 4 heads (2 kv), vocab 256 (c.json over preset tiny)")
    planned = json.loads(out.strip().splitlines()[-1])
    words = _printed_command(out, "train with: ")
    assert words[:2] == ["fitgpt", "train"] and "" not in words
    trained = parse(words[2:])
    expected = load_config("tiny", str(cfg_file), overrides={"model": {"context_length": 48}, "batch_size": 3, "grad_accum": 2,
                                                              "activation_checkpointing": planned["policy"]})
    assert trained == expected
    # train's own flags, under train's names: --model.*, --optim.*
    assert main(["plan", "--preset", "llama-tiny", "--model.n-blocks", "2", "--model.context-length", "32", "--batch-size", "1",
                 "--optim.impl", "foreach", "--memory-budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama, 2 blocks x 128 wide, 4 heads (2 kv), vocab 2048 (preset llama-tiny); batch 1 x context 32")
    trained = parse(_printed_command(out, "train with: ")[2:])
    assert (trained.model.n_blocks, trained.model.context_length, trained.optim.impl, trained.batch_size) == (2, 32, "foreach", 1)
    assert trained.model == dataclasses.replace(load_config("llama-tiny").model, n_blocks=2, context_length=32)
    words = shlex.split(train_command(dataclasses.replace(expected, parallel="fsdp"), world_size=2))
    assert words[:6] == ["torchrun", "--nproc-per-node", "2", "-m", "fitgpt", "train"] and parse(words[6:]).parallel == "fsdp"
    # fit's second half prints its best the same way (its first half, the largest sizes, is test_plan's).
    w = BudgetConfig(config=str(cfg_file), context=48, batch_size=3, grad_accum=2, precision="fp32", memory_budget="64MiB")
    result = fastest(w.workload, w.budget, top=1)
    best = result["choices"][0]
    trained = parse(_printed_command(format_choices(result, w.workload), "train the fastest: ")[2:])
    assert trained.model == expected.model and (trained.batch_size, trained.grad_accum) == (best.micro_batch, best.grad_accum)
    assert (trained.precision, trained.activation_checkpointing) == (best.precision, best.plan.spec())
