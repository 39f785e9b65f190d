"""The careless day at the new doors: export, --overwrite, prepared data, --init-from, generate, plan, bench and
torchrun. Each test failed on the code before its fix (issue 21)."""

import dataclasses
import gzip
import json
import re
from pathlib import Path

import pytest
import torch

from fitgpt.cli import main
from fitgpt.config import OptimConfig, TrainConfig
from fitgpt.data.config import DataConfig
from fitgpt.data.corpus import expand_inputs
from fitgpt.data.loader import TokenData
from fitgpt.data.prepare import prepare
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig, Transformer
from fitgpt.train.trainer import train
from fitgpt.utils import DirLock


def run_cli(args, capsys):
    """(exit code, stderr) of `fitgpt ARGS`; the flag parser's own exits count too."""
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def one_line(err: str) -> bool:
    """A user error: one `fitgpt CMD: error: ...` line, no traceback and no box (other libraries' warnings and
    progress bars may stand beside it). A library whose log handler still holds an earlier test's captured,
    closed stderr (transformers binds one at import) prints "--- Logging error ---" blocks: not ours, left out."""
    err = re.sub(r"--- Logging error ---\n.*?\nArguments: [^\n]*\n", "", err, flags=re.S)
    errors = [line for line in err.splitlines() if line.startswith("fitgpt ") and ": error: " in line]
    return len(errors) == 1 and "Traceback" not in err and "│" not in err


def snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.name != DirLock.FILE}


@pytest.fixture
def trained_run(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(cli_train_args(run, steps=2)) == 0
    capsys.readouterr()
    return run


# ---- data loss --------------------------------------------------------------------------------------------

def test_export_never_writes_into_a_run_a_checkpoint_or_prepared_data(trained_run, data_dir, capsys):
    pytest.importorskip("transformers")
    before, data_before = snapshot(trained_run), snapshot(data_dir)
    ckpt = sorted((trained_run / "checkpoints").iterdir())[-1]
    for out in (trained_run, ckpt, data_dir, trained_run / "checkpoints"):
        code, err = run_cli(["export", "--run", str(trained_run), "--out", str(out), "--overwrite"], capsys)
        assert code == 2 and one_line(err) and "which fitgpt keeps" in err, err
    assert snapshot(trained_run) == before and snapshot(data_dir) == data_before
    assert main(["generate", "--run", str(trained_run), "--max-new-tokens", "3"]) == 0  # the run still works


def test_overwrite_never_removes_prepared_data_or_a_users_files(cli_train_args, data_dir, tmp_path, capsys):
    data_before = snapshot(data_dir)
    args = cli_train_args(data_dir, steps=2)
    code, err = run_cli([*args, "--overwrite"], capsys)
    assert code == 2 and one_line(err) and "prepared data directory" in err
    assert snapshot(data_dir) == data_before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}')
    for extra in ([], ["--overwrite"]):
        code, err = run_cli([*cli_train_args(mine, steps=2), *extra], capsys)
        assert code == 2 and one_line(err) and "holds files fitgpt did not write (config.json)" in err
    assert (mine / "config.json").read_text() == '{"my": "settings"}'


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_run_that_never_trained_a_step_does_not_block_its_retry(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_cli([*cli_train_args(run, steps=2), "--activation-checkpointing", "auto", "--memory-budget", "1KiB"],
                        capsys)
    assert code == 2 and one_line(err) and (run / "config.json").is_file()  # written before the plan failed
    assert main(cli_train_args(run, steps=2)) == 0  # no --overwrite needed
    assert (run / "checkpoints").is_dir()


def test_prepare_resume_on_a_finished_folder_refuses_other_settings_and_changes_nothing(corpus_dir, tmp_path, capsys):
    d = tmp_path / "d"
    base = ["prepare", "--inputs", str(corpus_dir / "glob.py"), "--dir", str(d), "--vocab-size", "300"]
    assert main(base) == 0
    before = snapshot(d)
    for extra in (["--vocab-size", "400"], ["--inputs", str(corpus_dir / "glob.py"), str(corpus_dir / "heapq.py")],
                  ["--val-fraction", "0.2"]):
        code, err = run_cli([*base, *extra, "--resume"], capsys)
        assert code == 2 and one_line(err) and "finished preparation" in err, err
        assert snapshot(d) == before
    assert main([*base, "--resume"]) == 0 and snapshot(d) == before  # the same settings: nothing to do


# ---- silently wrong --------------------------------------------------------------------------------------

def test_records_without_text_are_counted_by_reason(tmp_path, capsys):
    records = [{"text": "def f():\n    return 1\n" * 20}, {"text": 7}, {"text": None}, {"text": ["a"]}, {"text": "  "},
               {"body": "x"}, {"text": "class A:\n    pass\n" * 20}]
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    meta = prepare(DataConfig(dir=str(tmp_path / "d"), inputs=(str(f),), vocab_size=300), progress=False)
    assert meta["documents"] == 2
    assert {k: v for k, v in meta["skipped"].items() if k.startswith("records_")} == \
        {"records_no_field": 1, "records_not_text": 3, "records_empty": 1}
    code, err = run_cli(["prepare", "--inputs", str(f), "--dir", str(tmp_path / "e"), "--vocab-size", "300"], capsys)
    assert code == 0 and "records without text" in err


def test_a_symlink_loop_is_read_once_and_a_name_with_glob_characters_is_a_path(tmp_path, monkeypatch):
    p = tmp_path / "p"
    p.mkdir()
    for i in range(10):
        (p / f"f{i}.py").write_text(f"x = {i}\n")
    (p / "self").symlink_to(".")
    (p / "notes[1].py").write_text("y = 1\n")
    monkeypatch.chdir(tmp_path)
    assert len(expand_inputs(["p/**/*.py"])) == 11 and len(expand_inputs(["p"])) == 11
    assert len(expand_inputs(["p/**/*.py", "p", "p/f1.py"])) == 11  # each file once
    assert expand_inputs(["p/notes[1].py"]) == [Path("p/notes[1].py")]
    assert expand_inputs([str(p / "f[12].py")]) == [p / "f1.py", p / "f2.py"]  # a real glob still globs


def test_short_shards_are_all_drawn_and_pass_the_context_check(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 3}) + "\n" for i in range(400)))
    d = tmp_path / "d"
    # Documents fall to val by a hash of their name, which holds tmp_path: at the default fraction a few go there, and
    # some tmp_paths left val under one window (468 tokens, in a fresh clone's quick loop). A tenth: about 40 of 400.
    meta = prepare(DataConfig(dir=str(d), inputs=(str(f),), vocab_size=300, shard_tokens=50, val_fraction=0.1),
                   progress=False)
    assert len(meta["shards"]["train"]) > 20 and meta["val_tokens"] > 513
    data = TokenData(d)
    data.check_context(512)  # no shard holds a window; the split does
    from fitgpt.data.loader import BatchSampler

    s = BatchSampler(data.splits["train"], 64, 512, seed=0)
    x, y = s.next_batch()
    assert x.shape == (64, 512) and (x[:, 1:] == y[:, :-1]).all()


def test_fsdp_in_one_process_is_refused_before_anything_is_written(cli_train_args, tmp_path, capsys):
    run = tmp_path / "run"
    code, err = run_cli([*cli_train_args(run, steps=2), "--parallel", "fsdp", "--fsdp-offload"], capsys)
    assert code == 2 and one_line(err) and "torchrun" in err
    assert not (run / "config.json").exists()


def test_a_data_dir_that_holds_nothing_is_not_prepared_with_the_builtin_corpus(tmp_path, capsys):
    code, err = run_cli(["train", "--data.dir", str(tmp_path / "no-such-data"), "--out-dir", str(tmp_path / "r"),
                         "--max-steps", "1", "--no-progress"], capsys)
    assert code == 2 and one_line(err) and "holds no prepared data" in err
    assert not list((tmp_path / "no-such-data").glob("*.bin"))


SETTINGS = {"inputs": ("other.txt",), "text_field": "body", "tokenizer": "gpt2", "vocab_size": 400, "tokenizer_sample": "1MB",
            "val_fraction": 0.3, "seed": 5, "shard_tokens": 1000}


def test_every_data_setting_is_either_the_datas_or_refused(data_dir, tmp_path):
    """Every DataConfig field but the directory: left at its default, the data's is used and recorded; given and
    different, the run is refused naming the flag (before, val_fraction and seed were ignored, then recorded)."""
    from fitgpt.data.prepare import ensure_prepared
    from fitgpt.data.prepared import adopt_prepared

    meta = json.loads((data_dir / "meta.json").read_text())
    fields = [f.name for f in dataclasses.fields(DataConfig) if f.name != "dir"]
    assert sorted(SETTINGS) == sorted(fields)  # a new setting gets a case here
    adopted = adopt_prepared(DataConfig(dir=str(data_dir)), meta)
    assert (adopted.val_fraction, adopted.seed, adopted.shard_tokens) == (meta["val_fraction"], meta["seed"], meta["shard_tokens"])
    for key, value in SETTINGS.items():
        with pytest.raises(UserError, match=f"--data.{key.replace('_', '-')}"):
            ensure_prepared(DataConfig(dir=str(data_dir), **{key: value}), progress=False)


def test_generate_never_draws_a_padding_id(tmp_path):
    from fitgpt.data.tokenizer import Tokenizer
    from fitgpt.sample import sample_text

    text = "def f(x):\n    return x + 1\n" * 50
    tok = Tokenizer(__import__("fitgpt.data.tokenizer", fromlist=["train_bpe"]).train_bpe([text], 300)._tok, "bpe")
    model = Transformer(ModelConfig(vocab_size=320, context_length=32, n_embed=32, n_head=4, n_blocks=1))
    with torch.no_grad():
        model.lm_head.weight[tok.vocab_size:] = 0
        model.lm_head.weight[tok.vocab_size:, 0] = 100.0  # the padding rows would win every draw
    model.eval()
    ids = model.generate(torch.zeros((4, 1), dtype=torch.long), 40, temperature=1.0, vocab_limit=tok.vocab_size)
    assert int(ids.max()) < tok.vocab_size
    assert all(isinstance(t, str) for t in sample_text(model, tok, "def", 5, 1.0, None, seed=0))


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_without_a_budget_gives_one_that_fits_the_card(monkeypatch, capsys):
    """The default budget is the card's; if the allocator replay says the plan's reserved memory does not fit on the
    card, the budget is lowered until it does (before: DOES NOT FIT, then `train with:` for that plan)."""
    from fitgpt.estimate.hardware import CUDA_CONTEXT, find_gpu
    from fitgpt.estimate.workload import Workload

    card = find_gpu("t4").memory
    budgets = []

    def replay(self, spec):
        budgets.append(spec)
        over = 200 * 2**20 if len(budgets) == 1 else 0  # the first plan's reserved memory overflows the card
        return {"max_allocated": card // 2, "max_reserved": card - CUDA_CONTEXT + over}

    monkeypatch.setattr(Workload, "replay", replay)
    capsys.readouterr()
    assert main(["plan", "--gpu", "t4", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert len(budgets) == 2 and "budget lowered by 202.0 MiB" in out and "train with:" in out and "DOES NOT FIT" not in out
    monkeypatch.setattr(Workload, "replay", lambda self, spec: {"max_allocated": 1, "max_reserved": card})
    assert main(["plan", "--gpu", "t4", "--preset", "tiny", "--memory-budget", "14GiB"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "train with:" not in out and '"fits_card": false' in out


def test_plan_refuses_bf16_on_a_card_without_it(capsys):
    code, err = run_cli(["plan", "--gpu", "t4", "--precision", "bf16"], capsys)
    assert code == 2 and one_line(err) and "has no bf16" in err


def test_resuming_with_another_model_names_the_setting(trained_run, cli_train_args, capsys):
    for flag, value in (("--model.arch", "llama"), ("--model.gelu", "tanh"), ("--model.tie-embeddings", "False")):
        code, err = run_cli([*cli_train_args(trained_run, steps=4), flag, value, "--resume", "latest"], capsys)
        assert code == 2 and one_line(err) and f"set {flag}" in err and "corrupt" not in err, err


# ---- one line instead of a traceback ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory, data_dir, corpus_dir):
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("exp")
    from fitgpt.config import load_config

    train(load_config("tiny", overrides={"model": {"n_embed": 32, "n_head": 4, "n_blocks": 1, "context_length": 32},
                                         "data": {"dir": str(data_dir), "inputs": [str(corpus_dir)], "vocab_size": 512},
                                         "max_steps": 1, "out_dir": str(root / "run"), "progress": False,
                                         "tensorboard": False}))
    assert main(["export", "--run", str(root / "run"), "--out", str(root / "hf")]) == 0
    return root / "hf"


def _damaged(src: Path, dst: Path, how: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if how == "config":
        (dst / "config.json").write_text("garbage{")
    elif how == "shapes":
        c = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**c, "vocab_size": c["vocab_size"] * 2}))
    elif how == "truncated":
        data = (dst / "model.safetensors").read_bytes()
        (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how == "tokenizer":
        (dst / "tokenizer.json").write_text("nope")
    return dst


@pytest.mark.parametrize("how", ["config", "shapes", "truncated", "tokenizer"])
def test_init_from_a_damaged_folder_is_one_line(exported, how, cli_train_args, tmp_path, capsys):
    folder = _damaged(exported, tmp_path / "hf", how)
    code, err = run_cli([*cli_train_args(tmp_path / "r", steps=1), "--init-from", str(folder)], capsys)
    assert code == 2 and one_line(err) and "--init-from" in err, repr(err)


def test_prepare_refuses_a_vocabulary_it_cannot_learn(corpus_dir, tmp_path, capsys):
    for size in ("999999999", "2000000"):
        code, err = run_cli(["prepare", "--inputs", str(corpus_dir / "glob.py"), "--dir", str(tmp_path / "d"),
                             "--vocab-size", size], capsys)
        assert code == 2 and one_line(err) and "vocab" in err


def test_a_corrupt_gzip_is_one_line(tmp_path, capsys):
    f = tmp_path / "c.jsonl.gz"
    good = gzip.compress(("".join(json.dumps({"text": f"line {i} " * 50}) + "\n" for i in range(200))).encode())
    f.write_bytes(good[:20] + bytes(b ^ 0x5A for b in good[20:200]) + good[200:])  # a damaged deflate stream
    code, err = run_cli(["prepare", "--inputs", str(f), "--dir", str(tmp_path / "d"), "--vocab-size", "300"], capsys)
    assert code == 2 and one_line(err) and "c.jsonl.gz" in err, err


def test_export_to_a_folder_it_cannot_write_is_one_line(trained_run, tmp_path, tmpfs, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "file").write_text("x")
    code, err = run_cli(["export", "--run", str(trained_run), "--out", str(tmp_path / "file" / "sub")], capsys)
    assert code == 2 and one_line(err) and "cannot write" in err
    ro = tmpfs("1m", ro=True)
    code, err = run_cli(["export", "--run", str(trained_run), "--out", str(ro / "hf")], capsys)
    assert code == 2 and one_line(err) and "cannot write" in err


@pytest.mark.skipif(getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available(), reason="has MPS")
def test_device_mps_without_mps_is_one_line(trained_run, tmp_path, capsys):
    for args in (["train", "--out-dir", str(tmp_path / "r")], ["generate", "--run", str(trained_run)],
                 ["plan", "--memory-budget", "1GiB"]):
        code, err = run_cli([*args, "--device", "mps"], capsys)
        assert code == 2 and one_line(err) and "MPS" in err, err


@pytest.mark.slow
def test_bench_takes_every_readme_policy_and_checks_its_output_first(tmp_path, capsys, monkeypatch):
    small = ["--batch-size", "1", "--context", "16", "--repeats", "1", "--warmup", "0"]
    assert main(["bench", *small, "--policies", "none", "offload", "--out-dir", str(tmp_path / "b")]) == 0
    assert "`offload`" in capsys.readouterr().out
    import fitgpt.cli.bench as bench_cli

    monkeypatch.setattr(bench_cli, "workload_for", lambda *a, **k: pytest.fail("measured before checking --out-dir"))
    (tmp_path / "file").write_text("x")
    code, err = run_cli(["bench", *small, "--out-dir", str(tmp_path / "file")], capsys)
    assert code == 2 and one_line(err) and "is a file" in err


def test_a_configs_own_checks_are_one_line(capsys):
    for args in (["generate", "--max-new-tokens", "0"], ["train", "--batch-size", "0"], ["prepare", "--val-fraction", "0.9"],
                 ["plan", "--world-size", "0", "--memory-budget", "1GiB"], ["export", "--run", "x"]):
        code, err = run_cli(args, capsys)
        assert code == 2 and one_line(err), (args, err)


@pytest.mark.parametrize("cls, section", [(ModelConfig, "model."), (OptimConfig, "optim."), (DataConfig, "data."),
                                          (TrainConfig, "")])
def test_no_setting_takes_nan_or_infinity(cls, section, capsys):
    floats = [f.name for f in dataclasses.fields(cls) if f.type in ("float", float)]
    assert floats
    for name in floats:
        for bad in ("inf", "nan", "-inf"):
            code, err = run_cli(["train", f"--{section}{name.replace('_', '-')}", bad], capsys)
            assert code == 2 and one_line(err) and f"--{section}{name.replace('_', '-')}" in err, (name, bad, err)
