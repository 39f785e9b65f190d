"""The careless day at the new doors: export, --overwrite, prepared data, --init-from, generate, plan, bench and
torchrun. Each test failed on the code before its fix (issue 21)."""

import dataclasses
import gzip
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.cli import main
from fitgpt.config import OptimConfig, TrainConfig
from fitgpt.data.config import DataConfig
from fitgpt.data.corpus import expand_inputs
from fitgpt.data.loader import TokenData
from fitgpt.data.prepare import prepare
from fitgpt.data.shards import PROGRESS_FILE, ShardWriter, save_progress
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
    meta = prepare(DataConfig(dir=str(d), inputs=(str(f),), vocab_size=300, shard_tokens=50), progress=False)
    assert len(meta["shards"]["train"]) > 20
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


# ---- activation checkpointing on other models ------------------------------------------------------------

def _hf_models():
    tf = pytest.importorskip("transformers")
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=3, n_head=4,
                                             bos_token_id=0, eos_token_id=0))
    llama = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                               bos_token_id=0, eos_token_id=0))
    return {"gpt2": gpt2, "llama": llama}


@pytest.mark.parametrize("spec", ["selective", "pointwise", "block"])
def test_op_level_policies_run_on_hugging_face_models_with_their_default_cache(spec):
    for name, model in _hf_models().items():
        assert model.config.use_cache  # the default, as a user has it
        apply_activation_checkpointing(model, spec)
        model.train()
        idx = torch.randint(0, 128, (2, 16))
        model(input_ids=idx, labels=idx).loss.backward()  # raised mid-backward before
        remove_activation_checkpointing(model)
        assert model.config.use_cache, name  # back as it was


class NanoBlock(nn.Module):
    """A nanoGPT-style block: hand-written causal attention (softmax, dropout on the weights), GELU MLP, dropout."""

    def __init__(self, C=32, H=4, p=0.1):
        super().__init__()
        self.ln_1, self.ln_2, self.H = nn.LayerNorm(C), nn.LayerNorm(C), H
        self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.c_fc, self.mlp_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.attn_dropout, self.resid_dropout, self.mlp_dropout = nn.Dropout(p), nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(C // self.H)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).tril().logical_not(), float("-inf"))
        y = self.attn_dropout(F.softmax(att, dim=-1)) @ v  # (B, nh, T, hs)
        x = x + self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.mlp_dropout(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class NanoGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.h, self.head = nn.Embedding(128, 32), nn.ModuleList(NanoBlock() for _ in range(4)), nn.Linear(32, 128)

    def forward(self, idx, targets):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return None, F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


def _step_flops(model, loss) -> int:
    model.train()
    with FlopCounterMode(display=False) as fc:
        loss(model).backward()
    return fc.get_total_flops()


def test_pointwise_runs_no_matmul_twice_with_dropout_and_gqa():
    """Before: 1.087x none's FLOPs on GPT-2 with dropout, 1.10x nanoGPT, 1.087x HF GPT-2, 1.025x Llama with GQA."""
    idx = torch.randint(0, 128, (2, 32))
    ours = lambda m: m(idx, idx)[1]  # noqa: E731
    hf = lambda m: m(input_ids=idx, labels=idx).loss  # noqa: E731
    models = {
        "gpt2+dropout": (Transformer(ModelConfig(vocab_size=128, context_length=32, n_embed=32, n_head=4, n_blocks=4,
                                                 dropout=0.1)), ours),
        "llama+gqa": (Transformer(ModelConfig(arch="llama", vocab_size=128, context_length=32, n_embed=32, n_head=4,
                                              n_kv_head=2, n_blocks=4)), ours),
        "nanogpt": (NanoGPT(), ours),
    }
    tf_models = _hf_models()
    tf_models["gpt2"].config.resid_pdrop = 0.1
    models |= {f"hf-{k}": (m, hf) for k, m in tf_models.items()}
    for name, (model, loss) in models.items():
        torch.manual_seed(0)
        none = _step_flops(model, loss)
        apply_activation_checkpointing(model, "pointwise")
        torch.manual_seed(0)
        assert _step_flops(model, loss) == none, name
        remove_activation_checkpointing(model)


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


# ---- scale -----------------------------------------------------------------------------------------------

def test_a_checkpoint_of_prepare_costs_what_happened_since_the_last(tmp_path):
    """progress.json stays the same size however many shards closed before (it listed them all: quadratic)."""
    dtype = np.dtype(np.uint16)
    w = ShardWriter(tmp_path, "train", dtype, shard_tokens=2)
    state: dict = {}
    sizes = []
    for _i in range(400):
        w.write(np.arange(3, dtype=dtype), doc_end=True)
        save_progress(tmp_path, {"train": w}, state)
        sizes.append((tmp_path / PROGRESS_FILE).stat().st_size)
    assert len(w.shards) == 400 and sizes[-1] - sizes[9] <= 8  # a few digits more, not 390 entries


def test_only_rank_0_keeps_the_gathered_state():
    from fitgpt.train import distributed as du

    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert du.full_model_state(model, keep=False) == {} and du.full_optimizer_state(opt, keep=False) is None
    assert set(du.full_model_state(model, keep=True)) == {"weight", "bias"}


def test_the_torch_floor_is_the_one_fsdp2_needs():
    root = Path(__file__).resolve().parent.parent
    assert '"torch>=2.6"' in (root / "pyproject.toml").read_text()
    assert "torch >= 2.6" in (root / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_under_torchrun_a_config_error_on_rank_0_stops_every_rank_in_one_line(data_dir, corpus_dir, tmp_path):
    from test_distributed import torchrun, train_flags

    run = tmp_path / "run"
    p = torchrun(train_flags(data_dir, corpus_dir, run, 2, "--activation-checkpointing", "auto", "--memory-budget", "1KiB"),
                 tmp_path)
    out, err = p.communicate(timeout=240)
    assert p.returncode != 0
    assert err.count("fitgpt train: error: ") == 2, err[-3000:]  # each rank, one line
    assert "Connection closed by peer" not in err and "src/fitgpt" not in err, err[-3000:]  # no traceback of ours
    code = subprocess.run([sys.executable, "-m", "fitgpt", *train_flags(data_dir, corpus_dir, run, 2)], cwd=tmp_path,
                          capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert code.returncode == 0, code.stderr[-2000:]  # the failed run left nothing that blocks the retry


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
def test_resuming_maps_the_optimizer_state_instead_of_reading_it(tmp_path):
    """Every rank resuming under FSDP loads state.pt: mapped, its 64 MiB of moments are not resident until used
    (before, each rank read the whole optimizer state into memory)."""
    from fitgpt.train import checkpoint as ckpt

    moments = {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(8 << 20), "exp_avg_sq": torch.rand(8 << 20)}}
    state = {"optimizer": {"state": moments, "param_groups": [{"params": [0]}]}, "scaler": {},
             "rng": {"torch": torch.get_rng_state()}}
    torch.save(state, tmp_path / ckpt.STATE_FILE)
    del state, moments
    before = _rss()
    loaded = ckpt.load_state(tmp_path, {}, [torch.Size([8 << 20])])
    assert _rss() - before < 16 << 20
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"][:4], loaded["optimizer"]["state"][0]["exp_avg"][:4])
