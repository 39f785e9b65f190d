"""The model a budget buys (issue 56): durations, the learning rate over a run of steps or of time, a run that ends on
its deadline and resumes counting the time spent, the law fitted and read back, the ladder, and fit --time-budget."""

import functools
import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from test_doors import one_line, run_cli

from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.optim import lr_at
from fitgpt.scaling.law import R_STAR, Coefficients, effective_tokens, fit_law, read_law
from fitgpt.train.deadline import Deadline
from fitgpt.train.distributed import DistInfo
from fitgpt.train.trainer import train
from fitgpt.units import parse_duration


def test_durations_parse_as_people_write_them():
    assert [parse_duration(t) for t in ("90s", "8m", "3h", "7d", "1h30m", "45", "1.5h")] == [
        90, 480, 10800, 604800, 5400, 45, 5400]
    for bad in ("", "x", "8mm", "m", "-3m", "1h1h", "3 h 2", "nan", "1e3"):
        with pytest.raises(UserError, match="--time-budget .* is not a duration"):
            parse_duration(bad)
    with pytest.raises(UserError, match="must be positive"):
        parse_duration("0s")


def test_wsd_holds_the_learning_rate_whatever_the_runs_length_then_cools_down_linearly():
    """The ladder's branches rest on it: a checkpoint in the stable part is the same step of any longer run."""
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=10, schedule="wsd", cooldown=0.2)
    assert lr_at(4, cfg, 100) == pytest.approx(5e-3)
    assert all(lr_at(s, cfg, 100) == lr_at(s, cfg, 1000) == 1e-2 for s in range(10, 80))
    assert lr_at(90, cfg, 100) == pytest.approx(1e-3 + 9e-3 * 0.5)
    assert lr_at(100, cfg, 100) == pytest.approx(1e-3)
    # Over a time budget: by the share of the time spent.
    assert lr_at(50, cfg, fraction=0.5) == 1e-2 and lr_at(50, cfg, fraction=0.9) == pytest.approx(5.5e-3)
    cosine = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=10)
    assert lr_at(55, cosine, 100) == pytest.approx(1e-3 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 9e-3)
    assert lr_at(10, cosine, fraction=1.0) == pytest.approx(1e-3)
    with pytest.raises(UserError, match="--optim.cooldown"):
        OptimConfig(cooldown=0.5)


def test_a_deadline_leaves_room_for_the_last_step_evaluation_and_checkpoint():
    """On a clock that moves 1 s a step: the run ends at the step after which another, the evaluation (as it was
    timed) and the checkpoint would pass the budget."""
    now = [0.0]
    d = Deadline(budget=20.0, spent_before=3.0, started=0.0, info=DistInfo(), device=None, eval_steps=1.0,
                 save_seconds=2.0, clock=lambda: now[0])
    ends = []
    for step in range(1, 30):
        now[0] += 1.0
        ends.append(d.last(step))
        if ends[-1]:
            break
    # After step k: spent 3 + k; another step (1 s), an evaluation (1 step: 1 s) and the save (2 s) need 4 s.
    assert len(ends) == 14 and ends[-1] and not any(ends[:-1])
    # The cooldown ends with the last step: its spent 17 s are all of the 20 s less the 3 s kept for the end.
    wsd = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=2, schedule="wsd", cooldown=0.2)
    assert d.lr(14, SimpleNamespace(optim=wsd)) == pytest.approx(1e-3)
    d.timed("eval", 5.0)  # a measured evaluation replaces the estimate
    assert d.last(15) and d.spent() == 17.0


def _meta(run):
    return json.loads(sorted((run / "checkpoints").glob("step_*/meta.json"))[-1].read_text())


@pytest.mark.slow
class Simulated:
    """A machine's clock on which a step takes ``step`` seconds, an evaluation ``evaluation`` and a save ``save``, and
    nothing else takes any: a run of a time budget then decides as the code says, never as the machine's load does
    (issue 68: the 4 s budget of the wall clock trained one step beside other work)."""

    def __init__(self, monkeypatch, step: float = 0.25, evaluation: float = 0.1, save: float = 0.01):
        from fitgpt.train import loop

        self.now = 1000.0
        for name, cost in (("_run_step", step), ("evaluate", evaluation), ("_save", save)):
            monkeypatch.setattr(loop, name, self._costing(getattr(loop, name), cost))

    def _costing(self, fn, cost):
        def timed(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.now += cost
            return out
        return timed

    def __call__(self) -> float:
        return self.now


@pytest.mark.slow
def test_a_run_of_a_time_budget_ends_with_its_last_evaluation_and_checkpoint_and_resumes_counting_its_time(
        make_cfg, tmp_path, monkeypatch):
    run = tmp_path / "run"
    flags = {"max_steps": 10**6, "eval_interval": 10**6, "checkpoint_interval": 10**6, "optim": {"schedule": "wsd"}}
    clock = Simulated(monkeypatch)
    summary = train(make_cfg(run, time_budget="4s", **flags), clock=clock)
    # 4 s of 0.25 s steps, less the last evaluation and save: 15 steps
    assert summary["steps"] == 15 and summary["val_loss"] is not None
    assert summary["checkpoint"].endswith(f"step_{summary['steps']:08d}")
    spent = _meta(run)["time_spent"]
    assert 0 < spent <= summary["time_spent"] <= 4.0  # the deadline kept, the last evaluation and save inside it
    lrs = [m["lr"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "lr" in m]
    assert lrs[-1] < make_cfg(run).optim.lr  # cooled down by the deadline
    with pytest.raises(UserError, match=r"spent .* of --time-budget 4s, so there is nothing to train; raise --time-budget"):
        train(make_cfg(run, time_budget="4s", resume="latest"), clock=clock)
    again = train(make_cfg(run, time_budget="6s", resume="latest", **flags), clock=clock)
    assert again["steps"] == 22 and spent < again["time_spent"] <= 6.0
    meta_file = sorted((run / "checkpoints").glob("step_*/meta.json"))[-1]
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "time_spent": "soon"}))  # hand-edited
    with pytest.raises(UserError, match="time_spent is 'soon', not a number of seconds"):
        train(make_cfg(run, time_budget="9s", resume=str(meta_file.parent)), clock=clock)


@pytest.mark.slow
def test_a_run_of_a_time_budget_continues_by_steps(make_cfg, tmp_path, capsys, monkeypatch):
    """``--config RUN/config.json --resume latest --max-steps N`` of a run of a time budget trains on to step N (it
    was refused, naming --time-budget, which the user never passed); ``--time-budget None`` says the same (it was a
    traceback)."""
    run = tmp_path / "run"
    assert train(make_cfg(run, time_budget="1s", max_steps=10**6), clock=Simulated(monkeypatch))["steps"] < 5
    monkeypatch.undo()
    code, err = run_cli(["train", "--config", str(run / "config.json"), "--resume", "latest", "--max-steps", "5"], capsys)
    assert code == 0, err
    assert json.loads((run / "config.json").read_text())["time_budget"] is None  # a run of steps from now on
    code, err = run_cli(["train", "--config", str(run / "config.json"), "--resume", "latest", "--time-budget", "None",
                         "--max-steps", "6"], capsys)
    assert code == 0, err
    assert sorted(p.name for p in (run / "checkpoints").iterdir())[-1] == "step_00000006"


@pytest.mark.slow  # three interpreters, each importing torch
def test_under_torchrun_a_budget_counts_from_the_launch_not_the_worker():
    """torchrun's own start-up and its workers' start came before the workers' clocks: time-budgeted launches ended
    2-4 s past their budget (issue 68). A worker of a first attempt counts from its launcher's start (here: this
    test's process, its parent, seconds older); a restarted one, or a process of no launcher, from its own."""
    import os
    import subprocess
    import sys

    code = "from fitgpt.utils import launch_age, process_age; print(launch_age(), process_age())"

    def ages(**env) -> tuple[float, float]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
        launch, own = map(float, out.stdout.split())
        return launch, own

    from fitgpt.utils import process_age

    before = process_age()
    launch, own = ages(TORCHELASTIC_RUN_ID="run", TORCHELASTIC_RESTART_COUNT="0")
    assert before - 0.02 <= launch <= process_age() + 0.02 and launch > own  # this process's age, read by its child
    for env in ({"TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_RESTART_COUNT": "1"}, {}):
        launch, own = ages(**env)
        # its own age, read twice a moment apart (a busy machine: a jiffy or two between them)
        assert launch == pytest.approx(own, abs=0.1) and launch < before


@pytest.mark.parametrize("args,needle", [(["--time-budget", "4m", "--max-steps", "10"], "drop one of them"),
                                         (["--time-budget", "soon"], "--time-budget 'soon' is not a duration")])
def test_train_refuses_a_time_budget_it_cannot_keep(args, needle, capsys, tmp_path):
    code, err = run_cli(["train", "--out-dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2 and one_line(err) and needle in err
    assert not (tmp_path / "run").exists()


TRUE = Coefficients(E=1.8, A=60.0, alpha=0.35, B=400.0, beta=0.3)
DATA = {"unique_tokens": 10**7, "tokenizer_sha256": "abc", "vocab_size": 512, "dir": "data"}


def _points(noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    return [{"n_params": n, "tokens": d, "val_loss": float(TRUE.loss(n, d) * math.exp(rng.normal(0, noise) if noise else 0))}
            for n in (5e4, 4e5, 1.3e6, 3e6) for d in (2e5, 5e5, 1.2e6)]


@functools.cache
def _exact_law():
    return fit_law(_points(), DATA, {}, resamples=2)


def test_repeated_tokens_count_as_muennighoffs_law_says():
    assert effective_tokens(5e6, 1e7) == 5e6
    assert effective_tokens(2e7, 1e7) == pytest.approx(1e7 + 1e7 * R_STAR * (1 - math.exp(-1 / R_STAR)))
    assert effective_tokens(1e9, 1e7) < 1e7 * (1 + R_STAR)  # never more than R* epochs' worth


def test_a_budgets_rows_count_repeats_of_the_data_they_train_on_not_the_laws():
    """`fit --time-budget --law --unique-tokens 1e12`: a row past the law's own data (10M unique tokens) is predicted
    as fresh tokens, as its epochs column says (2.61 here); it once repeated the law's 10M tokens 2,000 times (3.65)."""
    from fitgpt.plan.budget import predicted
    from fitgpt.scaling.law import Law

    law, n, tokens = Law(TRUE, [], [], [], DATA), 1e6, 2e10
    c = law.coefficients
    assert predicted(law, n, tokens, 1e12)[0] == pytest.approx(float(c.loss(n, tokens)), rel=1e-12)
    assert predicted(law, n, tokens, 1e7)[0] == pytest.approx(float(c.loss(n, effective_tokens(tokens, 1e7))), rel=1e-12)
    assert predicted(law, n, tokens, 1e12)[0] < predicted(law, n, tokens, 1e7)[0] - 0.1


@pytest.mark.slow
def test_the_law_is_fitted_through_its_points_and_read_back_exactly(tmp_path):
    law = fit_law(_points(), DATA, {"precision": "fp32"}, resamples=20)
    assert law.rms_residual < 1e-4  # exact points: the Huber fit finds a law through them
    for p in _points():
        assert law.predict(p["n_params"], p["tokens"])[0] == pytest.approx(p["val_loss"], rel=1e-3)
    law.write(tmp_path / "law.json")
    back = read_law(tmp_path / "law.json")
    assert back.coefficients == law.coefficients and back.bootstrap == law.bootstrap and back.data == DATA
    noisy = fit_law(_points(noise=0.02), DATA, {}, resamples=50)
    loss, low, high = noisy.predict(1e6, 1e6)
    assert low <= loss <= high and high - low > 0  # the bootstrap's interval


@pytest.mark.parametrize("edit,needle", [
    (lambda d: "{not json", "not a valid law file"),
    (lambda d: {**d, "version": 99}, "not a law file of this fitgpt"),
    (lambda d: {**d, "coefficients": {**d["coefficients"], "A": -1.0}}, "must be positive"),
    (lambda d: {**d, "coefficients": {**d["coefficients"], "E": "__import__('os')"}}, "coefficients.E is not a finite number"),
    (lambda d: {**d, "data": {**d["data"], "tokenizer_sha256": None}}, "tokenizer_sha256"),
    (lambda d: {**d, "residuals": []}, "one length"),
    (lambda d: {**d, "recipe": {"precision": "fp64"}}, "recipe.precision must be"),
])
def test_a_corrupt_or_hand_edited_law_is_one_line_naming_the_file(tmp_path, edit, needle):
    _exact_law().write(tmp_path / "law.json")
    edited = edit(json.loads((tmp_path / "law.json").read_text()))
    (tmp_path / "law.json").write_text(edited if isinstance(edited, str) else json.dumps(edited))
    with pytest.raises(UserError, match=rf"--law {tmp_path / 'law.json'}: .*{needle}"):
        read_law(tmp_path / "law.json")



@pytest.mark.slow
def test_a_laws_bootstrap_ends_at_its_deadline():
    """The ladder's 200 refits took 20-60 s of a 2-minute budget beside other work (issue 68): past its deadline the
    bootstrap stops, MIN_RESAMPLES refits at the least."""
    from fitgpt.scaling.law import MIN_RESAMPLES

    late = fit_law(_points(0.01), DATA, {}, resamples=200, deadline=0.0, clock=lambda: 1.0)
    assert len(late.bootstrap) == MIN_RESAMPLES
    assert len(fit_law(_points(0.01), DATA, {}, resamples=30, deadline=2.0, clock=lambda: 1.0).bootstrap) == 30

def test_too_few_points_for_a_law_is_one_line():
    with pytest.raises(UserError, match="at least 6 points"):
        fit_law(_points()[:5], DATA, {})


@pytest.mark.parametrize("args,needle", [
    pytest.param(["fit", "--time-budget", "3s", "--memory-budget", "1GiB"], "is spent before a run's first step",
                 marks=pytest.mark.slow),
    (["fit", "--law", "law.json", "--memory-budget", "1GiB"], "--law is for the rows of --time-budget"),
    (["fit", "--time-budget", "4m", "--unique-tokens", "0", "--memory-budget", "1GiB"], "--unique-tokens must be"),
    (["fit", "--time-budget", "4m", "--largest-model"], "drop one of them"),
    (["fit", "--time-budget", "a week", "--memory-budget", "1GiB"], "is not a duration"),
    (["ladder"], "--time-budget is required"),
    (["ladder", "--time-budget", "8m", "--depths", "3"], "at least two different depths"),
    (["ladder", "--time-budget", "8m", "--out", "law.txt"], "name a .json file"),
    (["ladder", "--time-budget", "8m", "--aspect", "48"], "--aspect 48: the family's width a block is 16, 32, 64 or 128"),
    (["ladder", "--time-budget", "8m", "--lr", "-0.1"], "--lr -0.1: give a positive learning rate"),
    # two depths a factor 7.9 apart cannot pin a parameter exponent: refused before any depth is timed
    (["ladder", "--time-budget", "8m", "--depths", "1", "2"], "--depths 1 2 span 7.9x in parameters; a law needs 10x"),
    # Below its runs' own start-ups, whatever the machine: refused before any run (once trained 37 s past a 2 s one)
    (["ladder", "--time-budget", "2s", "--depths", "1", "2"], "less than 2 depths' fixed costs"),
])
def test_fit_and_ladder_refuse_a_budget_they_cannot_answer_in_one_line(args, needle, data_dir, capsys, tmp_path):
    out = ["--work-dir", str(tmp_path / "w")] + ([] if "--out" in args else ["--out", str(tmp_path / "law.json")])
    out = out if args[0] == "ladder" else []
    code, err = run_cli([*args, *out, "--data.dir", str(data_dir)], capsys)
    assert code == 2 and one_line(err) and needle in err, err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_ladder_never_writes_over_a_law_or_an_earlier_ladder(data_dir, tmp_path, capsys):
    (tmp_path / "law.json").write_text("{}")
    code, err = run_cli(["ladder", "--time-budget", "8m", "--out", str(tmp_path / "law.json"), "--data.dir", str(data_dir)],
                        capsys)
    assert code == 2 and "exists: add --overwrite" in err and (tmp_path / "law.json").read_text() == "{}"
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "mine.txt").write_text("keep")
    code, err = run_cli(["ladder", "--time-budget", "8m", "--out", str(tmp_path / "new.json"), "--work-dir",
                         str(tmp_path / "ladder"), "--data.dir", str(data_dir)], capsys)
    assert code == 2 and "holds an earlier ladder's runs" in err and (tmp_path / "ladder" / "mine.txt").exists()


def test_the_law_is_drawn(tmp_path):
    from fitgpt.scaling.picture import draw_law

    png = draw_law(_exact_law(), tmp_path / "law.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_laws_fit_runs_each_descent_to_convergence():
    """Issue 56's 8-minute ladder (benchmarks/budget/law.json): scipy's default gradient tolerance stopped each
    descent near its start, at alpha 2.87 (2.619 as written there) from Hoffmann et al.'s 243 starts; run to
    convergence from the 8 best, alpha is on its bound, and the law says it is not identified. Issue 67's seed-1
    ladder, which its points identify, keeps its coefficients."""
    from pathlib import Path

    laws = Path(__file__).parents[1] / "benchmarks"
    old = read_law(laws / "budget" / "law.json")
    refit = fit_law(old.points, old.data, old.recipe, resamples=0)
    assert refit.coefficients.alpha > 2.99 and any("alpha" in p for p in refit.problems())
    seed1 = read_law(laws / "law" / "law.json")
    refit1 = fit_law(seed1.points, seed1.data, seed1.recipe, resamples=0)
    c = refit1.coefficients
    assert (round(c.E, 3), round(c.alpha, 3), round(c.beta, 3)) == (2.899, 0.552, 0.583) and not refit1.problems()
