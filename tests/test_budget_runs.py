"""The model a budget buys, end to end (issue 56): a ladder trained and its law fitted on the tests' data, and fit
--time-budget reading a law and printing a row per depth, the pick the least predicted loss."""

import dataclasses
import json
import shlex

import pytest
from test_budget import TRUE, Simulated
from test_doors import one_line, run_cli

from fitgpt.cli import main
from fitgpt.cli.train import parse
from fitgpt.data.loader import TokenData
from fitgpt.errors import UserError
from fitgpt.plan.budget import DEPTHS, STARTUP_SECONDS
from fitgpt.scaling.design import Rules
from fitgpt.scaling.family import Family, non_embedding_params
from fitgpt.scaling.ladder import FIT_RESERVE, LadderStopped, branch_steps, run_ladder
from fitgpt.scaling.law import fit_law, read_law

pytestmark = pytest.mark.slow
MECHANICS = Rules(min_tokens_per_param=0.0, saturated_tokens_per_param=0.0, min_range=1.0, identify=False)
"""The ladder's mechanics alone (stopping, continuing, its clock) on two tiny depths: no design, no law's check."""


def _simulated(monkeypatch, base, step: float = 0.5):
    """A simulated machine whose step takes ``step`` seconds, its throughput probe measuring as much."""
    from fitgpt.scaling import ladder

    tokens_per_step = base.batch_size * base.grad_accum * base.model.context_length
    monkeypatch.setattr(ladder, "measured_tokens_per_s", lambda cfg, device: tokens_per_step / step)
    return Simulated(monkeypatch, step=step)


def _check_points(law, base):
    tokens_per_step = base.batch_size * base.model.context_length
    for p in law.points:
        assert p["n_params"] == non_embedding_params(Family().shape(p["depth"], dataclasses.replace(base.model, vocab_size=512)))
        metrics = [json.loads(line) for line in open(f"{p['run']}/metrics.jsonl")]
        last = [m for m in metrics if "val_loss" in m][-1]
        assert last["val_loss"] == p["val_loss"] and last["step"] * tokens_per_step == p["tokens"]
        assert last["val_loss_se"] == p["val_loss_se"] > 0  # the point's evaluation noise, over its batches
        if p["how"] != "end":  # a cooldown over a fifth of the branch: from step s to s / 0.8
            start = int(p["how"].rsplit(" ", 1)[1])
            assert last["step"] == branch_steps(start, 0.2)


def test_a_ladder_stopped_by_ctrl_c_keeps_its_finished_depths_and_the_same_call_continues_it(make_cfg, tmp_path,
                                                                                             monkeypatch):
    """Ctrl-C in depth 1's run (issue 68: a traceback, a law with a null loss, and the same command refused): the
    ladder stops, depth 2 kept as it was; the same call trains depth 1 again, takes depth 2's points, counts the time
    the first try spent, and fits a law through three points a depth, each its run's loss. On a simulated clock (a
    step 0.5 s, an evaluation 0.1 s, a save 0.01 s): the ladder keeps its budget, its fit's share aside, however busy
    the machine is."""
    import os
    import signal

    from fitgpt.train import loop

    base = make_cfg(tmp_path / "unused", eval_batches=4)
    work = tmp_path / "ladder"
    clock = _simulated(monkeypatch, base)
    stepped = loop._run_step

    def ctrl_c_in_depth_1(run, *args, **kwargs):
        if run.cfg.out_dir.endswith("depth1"):
            os.kill(os.getpid(), signal.SIGINT)
        return stepped(run, *args, **kwargs)

    monkeypatch.setattr(loop, "_run_step", ctrl_c_in_depth_1)
    with pytest.raises(LadderStopped, match="stopped by SIGINT in .*depth1"):
        run_ladder(base, 48.0, (1, 2), work, overwrite=False, clock=clock, rules=MECHANICS)
    record = json.loads((work / "ladder.json").read_text())
    assert list(record["done"]) == ["2"] and not record["finished"]
    kept = {p: p.stat().st_mtime_ns for p in (work / "depth2").rglob("*")}
    monkeypatch.setattr(loop, "_run_step", stepped)
    spent_before = clock() - 1000.0
    law = run_ladder(base, 48.0, (1, 2), work, overwrite=False, clock=clock, rules=MECHANICS)
    assert len(law.points) == 6 and all(p["val_loss"] is not None for p in law.points)
    assert {p: p.stat().st_mtime_ns for p in (work / "depth2").rglob("*")} == kept
    assert [{k: p[k] for k in kept_point} for p, kept_point in zip(law.points, record["done"]["2"]["points"])] == \
        record["done"]["2"]["points"]
    assert clock() - 1000.0 <= 48.0 * (1 - FIT_RESERVE)  # both tries, within the budget
    assert spent_before > 0
    _check_points(law, base)
    assert law.data["tokenizer_sha256"] == TokenData(base.data.path).tokenizer_sha256
    law.write(tmp_path / "law.json")
    assert read_law(tmp_path / "law.json").points == law.points
    with pytest.raises(UserError, match="--work-dir .* holds an earlier ladder's runs: add --overwrite"):
        run_ladder(base, 48.0, (1, 2), work, overwrite=False, clock=clock, rules=MECHANICS)  # a finished ladder is not continued



def test_a_ladder_refused_at_its_first_depth_records_nothing(make_cfg, tmp_path, monkeypatch):
    """A first depth too slow for its share is refused before any run, and leaves no ladder.json behind (a larger
    budget then starts afresh rather than meeting "an earlier ladder's runs")."""
    base = make_cfg(tmp_path / "unused", eval_batches=4)
    _simulated(monkeypatch, base, step=60.0)  # a minute a step
    with pytest.raises(UserError, match="under 8 steps"):
        run_ladder(base, 60.0, (1, 2), tmp_path / "ladder", overwrite=False, rules=MECHANICS)
    assert not (tmp_path / "ladder").exists()

def test_the_ladder_command_stopped_says_so_in_one_line_and_writes_no_law(data_dir, tmp_path, capsys, monkeypatch):
    from fitgpt.scaling import ladder

    def stopped(*args, **kwargs):
        raise ladder.LadderStopped("stopped by SIGINT in runs/ladder/depth1")

    monkeypatch.setattr(ladder, "run_ladder", stopped)
    code, err = run_cli(["ladder", "--time-budget", "1m", "--out", str(tmp_path / "law.json"), "--data.dir",
                         str(data_dir), "--work-dir", str(tmp_path / "w")], capsys)
    lines = [line for line in err.splitlines() if line.startswith("fitgpt ladder: ")]
    assert code == 130 and len(lines) == 1 and "Traceback" not in err and "the same command continues it" in err, err
    assert not (tmp_path / "law.json").exists()


def test_a_cooldown_branch_trains_past_its_checkpoint_however_short_the_ladders_run():
    """A depth given MIN_STEPS (8) branches from step 2: round(2 / 0.8) is 2, a branch with nothing to train."""
    assert [branch_steps(s, 0.2) for s in (2, 4, 6, 8, 100)] == [3, 5, 8, 10, 125]


@pytest.fixture
def law_of(data_dir, tmp_path):
    """A law file of TRUE's coefficients for the tests' data (or another tokenizer's, ``sha``)."""
    def make(sha=None, recipe=None, unique=None):
        data = TokenData(data_dir)
        meta = data.meta
        points = [{"n_params": n, "tokens": d, "val_loss": float(TRUE.loss(n, d))} for n in (5e4, 4e5, 1.3e6, 3e6)
                  for d in (2e5, 5e5, 1.2e6)]
        law = fit_law(points, {"tokenizer_sha256": sha or data.tokenizer_sha256, "vocab_size": data.vocab_size,
                               "unique_tokens": int(unique or meta["train_tokens"]), "dir": str(data_dir)},
                      {"precision": "fp32", **(recipe or {})}, resamples=10)
        law.write(tmp_path / "law.json")
        return str(tmp_path / "law.json")
    return make


def test_fit_time_budget_prints_a_row_per_depth_the_pick_the_least_loss_and_commands_that_train_them(
        law_of, data_dir, capsys):
    """The law's family (32 a block, muP) and learning rate are the rows' (issue 67), and each row says how far past
    the law's points it reaches."""
    # min_lr as an older ladder saved it (0.0006000000000000001): the commands say 0.0006
    law = law_of(recipe={"aspect": 32, "mup": True, "lr": 0.006, "min_lr": 0.006 / 10, "eval_batches": 20})
    capsys.readouterr()
    assert main(["fit", "--time-budget", "30s", "--law", law, "--data.dir", str(data_dir), "--batch-size", "4",
                 "--context", "32", "--memory-budget", "2GiB"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    rows, pick = result["rows"], result["pick"]
    # How long its steps were timed, and how steady they were: each row's spread and seconds (issue 68)
    assert f"steps timed: {len(rows)} rows in " in out
    # (a spread, not a bound on it: a busy machine's tiny steps can vary past their median)
    assert all(0 <= r["tokens_per_s_spread"] < float("inf") and r["timed_seconds"] > 0 for r in rows)
    losses = [r["predicted_loss"] for r in rows]
    assert pick == losses.index(min(losses)) and result["law"] == law
    assert [r["depth"] for r in rows] == list(DEPTHS[:len(rows)])  # every depth to 8, then 10 (as fast as it measures)
    assert rows[-1]["params"] >= 8 * rows[pick]["params"] and rows[0]["depth"] == 1
    for r in rows:
        assert r["loss_low"] <= r["predicted_loss"] <= r["loss_high"]
        assert r["tokens"] == pytest.approx(r["tokens_per_s"] * (30 - STARTUP_SECONDS) / (1 + 20 / (3 * 100)), abs=1)
        command = shlex.split(r["command"])
        assert command[:2] == ["fitgpt", "train"] and "--time-budget" in command
        cfg = parse(command[2:])
        assert (cfg.model.n_blocks, cfg.model.n_embed, cfg.time_budget, cfg.optim.schedule) == (
            r["depth"], 32 * r["depth"], "30s", "wsd")
        assert (cfg.model.mup_base_width, cfg.model.mup_base_depth, cfg.optim.lr, cfg.optim.min_lr) == (32, 1, 0.006, 0.0006)
        assert cfg.eval_batches == 20  # the loss measured as the law's points' were
        assert cfg.batch_size * cfg.grad_accum == 4 and cfg.precision == "fp32"  # the law's recipe's precision
    # The law's points: 5e4 to 3e6 parameters, at most 6 x 3e6 x 1.2e6 FLOPs (points without their own count)
    table = [line for line in out.splitlines() if line.startswith("| ") and line.split("|")[1].strip()[:1].isdigit()]
    for r, line in zip(rows, table):
        beyond = line.rstrip(" |").rsplit("| ", 1)[1]
        parts = [f"{r['flops'] / (6 * 3e6 * 1.2e6):.1f}x their compute"] if r["flops"] > 6 * 3e6 * 1.2e6 else []
        parts += [f"{r['params'] / 3e6:.1f}x their parameters"] if r["params"] > 3e6 else []
        parts += [f"{5e4 / r['params']:.1f}x below their parameters"] if r["params"] < 5e4 else []
        assert beyond == (", ".join(parts) or "inside"), line
    assert "below their parameters" in table[0]  # depth 1 at 32 a block: 12,768


def test_a_law_of_this_tokenizer_prepared_otherwise_says_its_losses_are_of_other_windows(law_of, data_dir):
    """The same tokenizer, another split (the built-in corpus as an older fitgpt split it, by the files' paths): the
    rows' header says the law's points were evaluated on other windows, with both counts."""
    from fitgpt.cli.fit_budget import fitted_on
    from fitgpt.scaling.law import read_law

    meta = TokenData(data_dir).meta
    assert fitted_on(read_law(law_of()), meta) == "fitted on this data"
    other = fitted_on(read_law(law_of(unique=meta["train_tokens"] + 1000)), meta)
    assert other.startswith("fitted on this tokenizer's data prepared otherwise")
    assert f"{meta['train_tokens'] + 1000:,} training tokens against these {meta['train_tokens']:,}" in other


def test_fit_refuses_a_law_of_another_tokenizer(law_of, data_dir, capsys):
    code, err = run_cli(["fit", "--time-budget", "2m", "--law", law_of(sha="other"), "--data.dir", str(data_dir),
                         "--memory-budget", "1GiB"], capsys)
    assert code == 2 and one_line(err) and "was fitted on data of another tokenizer" in err


