"""Issue 46, classes 3-5, 7 and 8: no command's output replaces its own input or an earlier record; settings handed to
PyTorch are checked as PyTorch will read them; a restart is the same command; the run's own snapshot is the plan's
step event for event; plan_module names a wrong argument."""

import json

import pytest
import torch.nn as nn
from test_doors import exported, one_line, run_cli  # noqa: F401 (a fixture)

from fitgpt.errors import UserError
from fitgpt.plan.module import plan_module

PLAN = ["plan", "--preset", "tiny", "--memory-budget", "1GiB"]


# ---- class 3: one command's output never overwrites another's record ----------------------------------------

def test_an_output_that_would_replace_an_input_is_refused_before_anything_is_written(tmp_path, capsys):
    snap = tmp_path / "measured.pickle"
    snap.write_bytes(b"the measured record")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"max_steps": 3}))
    for flags in (["--compare", str(snap), "--memory-snapshot", str(snap)],
                  ["--config", str(config), "--memory-snapshot", str(config)],
                  ["--compare", str(tmp_path / "rep/plan.json"), "--report", str(tmp_path / "rep")]):
        (tmp_path / "rep").mkdir(exist_ok=True)
        (tmp_path / "rep/plan.json").write_text("{}")
        code, err = run_cli(PLAN + flags, capsys)
        assert code == 2 and one_line(err) and "would overwrite" in err, err
    assert snap.read_bytes() == b"the measured record" and json.loads(config.read_text()) == {"max_steps": 3}


def test_a_resumed_run_keeps_the_snapshot_of_its_first_steps(cli_train_args, tmp_path, capsys):
    """The documented resume, `--config RUN/config.json --resume latest`, does not record the snapshot again: a
    one-shot action is not a setting of the run."""
    run = tmp_path / "run"
    assert run_cli(cli_train_args(run, steps=2) + ["--memory-snapshot", "2"], capsys)[0] == 0
    first = (run / "memory_snapshot.pickle").read_bytes()
    assert json.loads((run / "config.json").read_text())["memory_snapshot"] == 0
    assert run_cli(["train", "--config", str(run / "config.json"), "--resume", "latest", "--max-steps", "4"], capsys)[0] == 0
    assert (run / "memory_snapshot.pickle").read_bytes() == first


# ---- class 7: the run's own snapshot is the plan's step, event for event ------------------------------------

@pytest.mark.parametrize("flags", [pytest.param([], marks=pytest.mark.slow), ["--log-interval", "1", "--eval-interval", "1"],
                                   pytest.param(["--grad-accum", "2"], marks=pytest.mark.slow)])
def test_a_runs_own_snapshot_is_its_plans_step_event_for_event(cli_train_args, tmp_path, capsys, flags):
    """The data loader's own temporaries are no part of the step; the batch is, as the plan makes it; logging,
    evaluation and saves between steps are not."""
    from fitgpt.cli import main

    run = tmp_path / "run"
    assert run_cli(cli_train_args(run, steps=3) + ["--memory-snapshot", "2", *flags], capsys)[0] == 0
    capsys.readouterr()
    assert main(["plan", "--config", str(run / "config.json"), "--memory-budget", "1GiB", "--activation-checkpointing",
                 "none", "--compare", str(run / "memory_snapshot.pickle")]) == 0
    out = capsys.readouterr().out
    assert "the same step, event for event" in out, out


# ---- class 4: settings handed to PyTorch are checked ---------------------------------------------------------

@pytest.mark.parametrize("conf,says", [("expandible_segments:True", "has no setting 'expandible_segments'"),
                                       ("expandable_segments:maybe", "True or False"),
                                       ("expandable_segments:true", "True or False"),
                                       ("max_split_size_mb:abc", "a whole number"),
                                       ("", "--alloc-conf is empty")])
def test_allocator_settings_pytorch_would_refuse_are_refused(conf, says, capsys, monkeypatch):
    code, err = run_cli(PLAN + ["--gpu", "h100-80gb", "--alloc-conf", conf], capsys)
    assert code == 2 and one_line(err) and says in err, err
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf or "expandable_segments:True,backend:nope")
    code, err = run_cli(["plan", "--preset", "tiny", "--gpu", "h100-80gb"], capsys)
    assert code == 2 and one_line(err) and "PYTORCH_CUDA_ALLOC_CONF" in err, err


def test_allocator_settings_pytorch_reads_are_accepted():
    from fitgpt.memory.allocator import expandable_from

    assert expandable_from("garbage_collection_threshold:0.6,roundup_power2_divisions:[256:1,>:8],expandable_segments:True")
    assert not expandable_from("backend:cudaMallocAsync,pinned_num_register_threads:8,expandable_segments:False")


# ---- class 5: a restart is the same command ------------------------------------------------------------------

def test_init_from_with_resume_auto_restarts_as_the_same_command(exported, cli_train_args, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    for steps in (2, 4):  # the first launch starts the run from the folder, the second continues it
        code, err = run_cli(cli_train_args(run, steps=steps) + ["--init-from", str(exported), "--resume", "auto"], capsys)
        assert code == 0, err
    assert json.loads((run / "checkpoints/step_00000004/meta.json").read_text())["step"] == 4


def test_resume_onto_data_of_another_tokenizer_names_the_tokenizer(cli_train_args, corpus_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert run_cli(cli_train_args(run, steps=2), capsys)[0] == 0
    other = cli_train_args(run, steps=4) + ["--resume", "auto"]
    other[other.index("--data.dir") + 1] = str(tmp_path / "d300")
    other[other.index("--data.vocab-size") + 1] = "300"
    code, err = run_cli(other, capsys)
    assert code == 2 and one_line(err) and "another tokenizer" in err and "--model.vocab-size" not in err, err


# ---- class 8: plan_module's arguments ------------------------------------------------------------------------

@pytest.mark.parametrize("kw,names", [({"world_size": "2"}, "world_size='2'"), ({"world_size": 2.5}, "world_size=2.5"),
                                      ({"grad_accum": 0}, "grad_accum=0"), ({"budget": -1}, "budget=-1"),
                                      ({"precision": "bf15"}, "precision='bf15'"), ({"parallel": "tp"}, "parallel='tp'"),
                                      ({"vocab_size": None}, "vocab_size=None")])
def test_plan_module_names_a_wrong_argument_before_any_work(kw, names):
    args = {"vocab_size": 32, **kw}
    with pytest.raises(UserError, match=f"plan_module: {names.replace('(', '[(]')}"):
        plan_module(lambda: nn.Linear(2, 2), (2, 8), **args)
    with pytest.raises(UserError, match="plan_module: batch="):
        plan_module(lambda: nn.Linear(2, 2), (2, "8"), vocab_size=32)
