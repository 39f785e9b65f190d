"""Fault injection: kills, kills mid-save, full disks, corrupt files, OOM, and fuzzed input."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from hang import guard
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from fitgpt.cli import main
from fitgpt.config import TrainConfig, from_dict, to_dict
from fitgpt.errors import UserError
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.loop import TrainingError
from fitgpt.train.trainer import train
from fitgpt.units import parse_bytes


def run_script(body: str, args: list, **kw) -> subprocess.Popen:
    """``python -c`` with ``body`` run first (to plant a fault), then the fitgpt CLI on ``args``."""
    code = textwrap.dedent(body) + f"\nimport sys\nfrom fitgpt.cli import main\nsys.exit(main({args!r}))\n"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def final_weights(run):
    return load_file(str(ckpt.list_checkpoints(run)[-1] / ckpt.MODEL_FILE))


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_resume_equals_an_uninterrupted_run(data_dir, corpus_dir, tmp_path, cli_train_args, test_rng):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    p = run_script("", cli_train_args(straight))
    assert p.wait(timeout=guard(300)) == 0, p.stderr.read()
    kill_after = test_rng.randint(3, 9)
    # Steps slowed (not changed) so that the kill lands mid-run on any machine.
    slow = """
        import time
        from fitgpt.data import loader
        real = loader.BatchSampler.next_batch
        def slow_next_batch(self, *a, **kw):
            time.sleep(0.1)
            return real(self, *a, **kw)
        loader.BatchSampler.next_batch = slow_next_batch
    """
    p = run_script(slow, cli_train_args(killed))
    metrics = killed / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and p.poll() is None:
        if metrics.is_file() and metrics.read_text().count('"loss"') >= kill_after:
            break
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=guard(60))
    assert p.returncode == -signal.SIGKILL, f"the run ended before it could be killed (step {kill_after})"
    last = ckpt.list_checkpoints(killed)[-1]
    assert json.loads((last / "meta.json").read_text())["step"] < 12
    p = run_script("", [*cli_train_args(killed), "--resume", "latest"])
    out, err = p.communicate(timeout=guard(300))
    assert p.returncode == 0, err
    assert f"resumed from {last}" in err
    a, b = final_weights(straight), final_weights(killed)
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_as_latest(data_dir, corpus_dir, tmp_path, cli_train_args):
    run = tmp_path / "run"
    # On the second save, write half the weights file, then die as a SIGKILL would have it.
    plant = """
        import os, signal
        import fitgpt.train.checkpoint as c
        real, calls = c.save_model, []
        def dying(model, path):
            calls.append(path)
            real(model, path)
            if len(calls) == 2:
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.truncate(size // 2)
                os.kill(os.getpid(), signal.SIGKILL)
        c.save_model = dying
    """
    p = run_script(plant, cli_train_args(run))
    p.communicate(timeout=guard(300))
    assert p.returncode == -signal.SIGKILL
    root = run / "checkpoints"
    assert [d.name for d in ckpt.list_checkpoints(run)] == ["step_00000002"]
    assert any(d.name.startswith(".tmp_step_00000004") for d in root.iterdir())  # the half-written one
    path, meta = ckpt.resolve_resume(run, "latest")
    assert path.name == "step_00000002" and meta["step"] == 2
    p = run_script("", [*cli_train_args(run, steps=6), "--resume", "latest"])
    out, err = p.communicate(timeout=guard(300))
    assert p.returncode == 0, err
    assert "checkpoint whose writing was interrupted" in err
    assert not any(d.name.startswith(".tmp") for d in root.iterdir())
    assert ckpt.list_checkpoints(run)[-1].name == "step_00000006"


def test_out_of_memory_names_the_plan_command(data_dir, corpus_dir, tmp_path, monkeypatch, make_cfg):
    import fitgpt.train.trainer as trainer

    real_build = trainer.build_model

    def oom_model(cfg, vocab_size, device, *shards):
        model = real_build(cfg, vocab_size, device, *shards)

        def boom(*a, **kw):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

        model.forward = boom
        return model

    monkeypatch.setattr(trainer, "build_model", oom_model)
    with pytest.raises(TrainingError, match=r"out of memory at step 0 .*fitgpt plan --preset tiny --batch-size 4 --context 32"):
        train(make_cfg(tmp_path / "run"))


def test_generate_refuses_a_run_whose_config_or_tokenizer_does_not_match(data_dir, corpus_dir, tmp_path, capsys, make_cfg):
    run = tmp_path / "run"
    train(make_cfg(run, max_steps=3))
    last = ckpt.list_checkpoints(run)[-1]
    meta = json.loads((last / "meta.json").read_text())
    meta["config"]["model"]["n_embed"] = 64
    (last / "meta.json").write_text(json.dumps(meta))
    assert main(["generate", "--run", str(run), "--max-new-tokens", "2"]) == 2
    assert "model.safetensors does not fit this model" in capsys.readouterr().err
    meta["config"]["model"]["n_embed"] = 32
    (last / "meta.json").write_text(json.dumps(meta))
    shutil.copy(corpus_dir / "bisect.py", run / "tokenizer.json")
    assert main(["generate", "--run", str(run), "--max-new-tokens", "2"]) == 2
    assert "is not the tokenizer the checkpoint" in capsys.readouterr().err


@pytest.mark.slow  # 3.2-3.4 s here
def test_train_auto_with_a_budget_below_the_fixed_costs_is_a_user_error(data_dir, corpus_dir, tmp_path, capsys, cli_train_args):
    args = cli_train_args(tmp_path / "run", steps=2) + ["--activation-checkpointing", "auto", "--memory-budget", "64KiB"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "nothing fits in 64.0 KiB" in err and "alone take" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---- fuzzing: arbitrary input gives a valid object or a ValueError, never a crash --------------------

text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=True), text),
                           lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
                           max_leaves=8)
keys = st.sampled_from(["batch_size", "grad_accum", "max_steps", "activation_checkpointing", "memory_budget", "precision", "device",
                        "model", "optim", "data", "seed", "bogus", "keep_last", "resume"])
model_keys = st.sampled_from(["n_embed", "n_head", "n_blocks", "context_length", "vocab_size", "dropout", "bias", "checkpointing"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(keys, json_values, max_size=4), st.dictionaries(model_keys, json_values, max_size=3))
def test_config_parsing_fuzz(top, model):
    data = dict(top)
    if model:
        data["model"] = model
    try:
        cfg = from_dict(TrainConfig, data, "fuzz.json")
    except UserError:
        return
    assert from_dict(TrainConfig, to_dict(cfg), "round trip") == cfg  # what a run saves loads back as the same config


@settings(max_examples=300, deadline=None)
@given(text)
def test_budget_parser_fuzz(s):
    try:
        assert parse_bytes(s) > 0
    except UserError:
        pass
