"""The plan, bench and fit commands: what they print, write and refuse, and fit's answers confirmed by real steps
(moved from test_plan.py, issue 47: files under 400 lines)."""

import dataclasses
import json
import shlex

import pytest
from test_plan import B, Measured, T

from fitgpt.cli import main
from fitgpt.cli.workload import BudgetConfig
from fitgpt.config import load_config
from fitgpt.errors import UserError
from fitgpt.estimate.profile import profile_model
from fitgpt.plan import Plan, predict, solve
from fitgpt.plan.largest import largest


def test_plan_command(capsys):
    assert main(["plan", "--device", "cpu", "--batch-size", "4", "--context", "32", "--memory-budget", "40MiB"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["predicted_peak"] <= 40 * 2**20
    assert f"--activation-checkpointing {shlex.quote(result['policy'])}" in out


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_prints_the_plan_it_solved_not_the_tables_last_row(capsys):
    """With room for everything the fastest plan is none; the table of uniform plans printed after solving once
    overwrote it, so every answer (and its peak, its replay, its train command) was the last row's."""
    args = ["plan", "--batch-size", "2", "--context", "32", "--memory-budget", "1GiB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    profile = BudgetConfig(batch_size=2, context=32, memory_budget="1GiB").workload.profile()
    solved, pred = solve(profile, 2**30)
    assert result["policy"] == solved.spec() == "none" and result["predicted_peak"] == pred.peak
    assert "plan: none (the fastest that fits" in out and "--activation-checkpointing none" in out


@pytest.mark.slow
def test_plan_predicts_the_policy_the_train_command_names(capsys):
    """--activation-checkpointing as train takes it: the policy predicted as given (a group of two blocks as its nearest
    profiled plan), its train command carrying it; one over the budget gets no train command."""
    flags = ["--batch-size", "2", "--context", "32", "--memory-budget", "1GiB"]
    profile = BudgetConfig(batch_size=2, context=32, memory_budget="1GiB").workload.profile()
    n = profile.n_blocks
    assert main(["plan", *flags, "--activation-checkpointing", "selective+chunked-loss"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["policy"] == "selective+chunked-loss" and result["fits_budget"]
    assert result["predicted_peak"] == predict(profile, Plan.uniform(n, "selective", "chunked")).peak
    assert "--activation-checkpointing selective+chunked-loss" in out and "plan: selective+chunked-loss (as given; fits" in out
    small = predict(profile, Plan.uniform(n, "block")).peak - 1  # the group:2 plan needs more than block's
    assert main(["plan", *flags[:-1], f"{small}B", "--activation-checkpointing", "group:2"]) == 0
    out = capsys.readouterr().out
    assert "predicted as block, its nearest profiled plan; DOES NOT FIT the budget" in out
    assert "no train command" in out and "train with" not in out
    # offload is profiled for CUDA only (on a CPU it moves nothing): its nearest plan is none (before: a KeyError)
    assert main(["plan", *flags, "--activation-checkpointing", "offload"]) == 0
    out = capsys.readouterr().out
    assert "plan: offload (as given, predicted as none, its nearest profiled plan; fits" in out
    assert main(["plan", *flags, "--activation-checkpointing", "blok"]) == 2
    assert "unknown checkpointing term 'blok'" in capsys.readouterr().err


@pytest.mark.slow
def test_torchtitan_rule_is_profiled_when_named_and_predicted_exactly(tiny_model_config, capsys):
    """torchtitan's op-level rule, for a torchtitan user to compare like with like: profiled only when a policy names
    it (auto's four steps stay four), then predicted as exactly as the others, alone and mixed."""
    cfg = tiny_model_config(arch="llama", n_kv_head=2)
    assert "torchtitan" not in profile_model(cfg, B, T, fake=True).blocks[0]
    profile = profile_model(cfg, B, T, fake=True, extra_options=("torchtitan",))
    measured = Measured(cfg)
    for plan in [Plan.uniform(4, "torchtitan"), Plan(("torchtitan", "none", "block", "torchtitan"), "chunked")]:
        assert predict(profile, plan).peak == measured.peak(plan)
    args = ["plan", "--preset", "llama-tiny", "--batch-size", "2", "--context", "32", "--memory-budget", "1GiB",
            "--activation-checkpointing", "torchtitan+chunked-loss"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "plan: torchtitan+chunked-loss (as given; fits" in out and "--activation-checkpointing torchtitan+chunked-loss" in out


def test_plan_command_errors_name_the_flag(capsys):
    assert main(["plan", "--device", "cpu"]) == 2
    assert "--memory-budget is required" in capsys.readouterr().err
    assert main(["plan", "--device", "cpu", "--batch-size", "4", "--context", "32", "--memory-budget", "1MiB"]) == 2
    assert "the weights alone" in capsys.readouterr().err  # refused before anything is profiled
    assert main(["plan", "--device", "cpu", "--batch-size", "4", "--context", "32", "--memory-budget", "8MiB"]) == 2
    assert "nothing fits in 8.0 MiB" in capsys.readouterr().err
    # A budget under a card's cuBLAS workspaces (16 MiB on an A100, modelled): named so, not as a negative budget
    assert main(["plan", "--gpu", "a100-80gb", "--preset", "tiny", "--memory-budget", "10MiB"]) == 2
    assert "--memory-budget 10MiB leaves nothing for the step's tensors" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_command_writes_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "b"
    args = ["bench", "--device", "cpu", "--batch-size", "8", "--context", "128", "--repeats", "1", "--warmup", "0",
            "--policies", "none", "block", "auto:50%", "auto:1MiB", "--out-dir", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    result = json.loads(text.strip().splitlines()[-1])
    rows = {r["policy"]: r for r in result["rows"]}
    assert set(rows) == {"none", "block", "auto:50%"}  # auto:1MiB cannot fit: reported, not fatal
    assert "auto:1MiB" in result["setup"]["skipped"] and "nothing fits in 1.0 MiB" in text
    assert rows["block"]["activation_bytes"] < rows["none"]["activation_bytes"]
    assert rows["block"]["flops"] > rows["none"]["flops"]
    assert rows["auto:50%"]["peak_bytes"] <= rows["auto:50%"]["budget_bytes"]
    assert (out / "bench.json").is_file() and (out / "bench.png").stat().st_size > 0
    assert "| `block` |" in text
    # Where the memory goes, per policy: a measured step's snapshot beside the predicted one (issue 38)
    assert (out / "memory.png").stat().st_size > 0 and result["memory_png"] == str(out / "memory.png")
    from fitgpt.memory.snapshot import read_snapshot, step_events

    assert step_events(read_snapshot(out / "memory_block.pickle"))


@pytest.mark.slow
def test_bench_takes_the_policy_train_takes(tmp_path, capsys):
    """--activation-checkpointing on bench measures that policy beside none (torchtitan's rule profiled for the
    prediction beside it, not a nearest plan)."""
    args = ["bench", "--device", "cpu", "--preset", "llama-tiny", "--batch-size", "2", "--context", "32", "--repeats", "1",
            "--warmup", "0", "--out-dir", str(tmp_path / "b"), "--activation-checkpointing", "torchtitan"]
    assert main(args) == 0
    rows = {r["policy"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}
    assert set(rows) == {"none", "torchtitan"} and rows["torchtitan"]["predicted_exact"]
    assert rows["torchtitan"]["flops"] > rows["none"]["flops"]
    assert main([*args, "--policies", "none", "block"]) == 2
    assert "give one of the two" in capsys.readouterr().err


@pytest.mark.slow
def test_fit_command(tmp_path, capsys):
    """The largest sizes under none, block, auto and the policy --activation-checkpointing names (as train takes it),
    which every fastest configuration then keeps (at most --top of them), its train command carrying it; --report
    draws where the fastest one's memory goes."""
    args = ["fit", "--batch-size", "4", "--context", "32", "--memory-budget", "60MiB", "--precision", "fp32", "--top", "3",
            "--activation-checkpointing", "selective", "--report", str(tmp_path / "report")]
    assert main(args) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    a = result["answers"]
    assert result["policies"] == ["none", "block", "auto", "selective"] and "| selective vs none |" in out
    for key in ("batch_size", "context", "n_blocks"):
        assert a["auto"][key] >= a["block"][key] >= a["none"][key] >= 1, key
        assert a["auto"][key] >= a["selective"][key] >= a["none"][key], key
    assert a["block"]["batch_size"] > a["none"]["batch_size"]
    assert 1 <= len(result["fastest"]) <= 3 and all(c["policy"] == "selective" for c in result["fastest"])
    assert "train the fastest: fitgpt train" in out and "--activation-checkpointing selective" in out
    assert (tmp_path / "report/fit.png").stat().st_size > 0


def test_train_config_budget_errors():
    with pytest.raises(UserError, match="--memory-budget"):
        load_config("tiny", overrides={"activation_checkpointing": "auto"})
    with pytest.raises(UserError, match="--activation-checkpointing auto"):
        load_config("tiny", overrides={"activation_checkpointing": "block", "memory_budget": "1GiB"})
    with pytest.raises(UserError, match="is not a size"):
        load_config("tiny", overrides={"activation_checkpointing": "auto", "memory_budget": "lots"})


@pytest.mark.slow
@pytest.mark.parametrize("preset, batch, context, budget, dims", [
    ("tiny", 4, 32, "24MiB", ("batch_size", "context")),
    # The small preset (124M parameters) takes two minutes: `python benchmarks/plan_check.py cpu` runs it.
])
def test_fit_answers_are_confirmed_by_real_steps_at_the_sizes_named(preset, batch, context, budget, dims):
    """fit settles on fake profiles of the sizes it names: a real step of that size fits the budget, one
    size more does not, and both measured peaks are the predicted ones within 1%."""
    flags = BudgetConfig(preset=preset, batch_size=batch, context=context, grad_accum=1, memory_budget=budget)
    w, budget = flags.workload, flags.budget
    answers = largest(w, budget)["answers"]
    cfg = w.train.model
    for policy, option in (("none", "none"), ("block", "block")):
        b, c = answers[policy]["batch_size"], answers[policy]["context"]
        assert b > batch and c > context  # the budget leaves room beyond the profiled sizes
        sizes = [(b, context, True), (b + 1, context, False)]
        if "context" in dims:
            sizes += [(batch, c, True), (batch, c + 1, False)]
        for n, t, fits in sizes:
            model_cfg = dataclasses.replace(cfg, context_length=max(t, cfg.context_length))
            plan = Plan.uniform(cfg.n_blocks, option)
            measured = Measured(model_cfg, n, t).peak(plan)
            predicted = predict(w.profile(n, t), plan).peak
            assert abs(measured - predicted) <= 0.01 * measured, (policy, n, t)
            assert (measured <= budget) == fits, (policy, n, t, measured, budget)


@pytest.mark.parametrize("guess", [0, 1, 37, 99, 100, 101, 180, 5000])
def test_settle_finds_the_largest_size_that_fits_from_any_guess(guess, monkeypatch):
    from fitgpt.plan import largest as largest_module

    peak = {n: 1000 * n + (512 if n % 7 == 0 else 0) for n in range(0, 5002)}  # linear with a ripple
    monkeypatch.setattr(largest_module, "_excess", lambda profile, policy, budget: profile - budget)
    probes = []

    def exact(n):
        probes.append(n)
        return peak[n]

    assert largest_module._settle(exact, "none", 100_300, guess, 5000) == 100  # 100 fits, 101 does not
    assert len(probes) <= 8, probes
    assert largest_module._settle(lambda n: peak[n], "none", 500, guess, 5000) == 0  # not even 1 fits
    assert largest_module._settle(lambda n: peak[n], "none", 10**9, guess, 5000) == 5000  # the cap
