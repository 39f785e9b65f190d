"""The careless day, part 4: the new doors (optimizer options, fit, auto-config, Hugging Face configs, plan_module),
formats at the edges, stuck users and misleading messages. Each test failed on the code before its fix (issue 37);
"(own)" marks a case found beside the reported one, of the same class."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_doors import one_line, run_cli, snapshot

from fitgpt.activation_checkpoint import applied_policy, apply_activation_checkpointing
from fitgpt.cli import main
from fitgpt.config import load_config
from fitgpt.data.config import DataConfig
from fitgpt.data.prepare import prepare
from fitgpt.errors import UserError
from fitgpt.plan import plan_module

V, C = 256, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


class Net(nn.Module):
    """A hand-written LM whose forward answers as ``kind`` says."""

    def __init__(self, kind: str = "pair", buffer: int = 0):
        super().__init__()
        self.kind = kind
        self.emb = nn.Embedding(V, C)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(C, V)
        if buffer:
            self.register_buffer("table", torch.zeros(buffer // 4))
        if kind == "attribute":
            self.scale = torch.ones(C)

    def forward(self, idx, targets):
        x = self.emb(idx)
        if self.kind == "attribute":
            x = x * self.scale
        for b in self.blocks:
            x = b(x)
        logits = self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return {"logits": logits, "loss-only": (loss,), "loss-first": (loss, logits)}.get(self.kind, (logits, loss))


# ---- data loss --------------------------------------------------------------------------------------------

@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_fsdp_with_low_bit_adamw_is_launched_and_planned(capsys):
    """Every checkpoint save under FSDP crashed on every rank (torchao's quantized moments have no sharding); then it
    was refused. Now each matrix steps whole on one rank (`fitgpt.optim.whole`): the launch, plan and fit's layouts
    take it (trained and checkpointed: test_split_optimizer_runs.py)."""
    from fitgpt.estimate.workload import workload_for
    from fitgpt.plan.fastest import _layouts
    from fitgpt.train.distributed import DistInfo
    from fitgpt.train.trainer import _check_launch

    cfg = load_config("tiny", overrides={"parallel": "fsdp", "optim": {"name": "adamw8bit"}, "device": "cpu"})
    _check_launch(cfg, DistInfo(rank=0, world=2))
    code, err = run_cli(["plan", "--world-size", "2", "--parallel", "fsdp", "--optim.name", "adamw4bit",
                         "--memory-budget", "1GiB"], capsys)
    assert code == 0, err
    w = workload_for(load_config("tiny", overrides={"optim": {"name": "adamw8bit"}}), target=None, fake=True, world_size=2)
    assert "fsdp" in [layout.name for layout in _layouts(w)]


# ---- silently wrong ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--optim.in-backward", "--optim.offload"])
def test_plan_for_a_card_whose_auto_is_fp16_refuses_what_the_trainer_refuses(flag, capsys):
    code, err = run_cli(["plan", "--gpu", "t4", flag], capsys)
    assert code == 2 and one_line(err) and "--precision fp32" in err


@pytest.mark.slow
def test_largest_model_rows_on_a_t4_train_in_a_precision_the_trainer_takes():
    """A step in the backward on a T4 (auto: fp16) is planned, and printed, in fp32 (before: the command had no
    --precision, and the trainer refused it on the card)."""
    from fitgpt.cli.workload import BudgetConfig, parse_workload
    from fitgpt.command import train_command
    from fitgpt.plan.family import largest_model

    cfg = parse_workload(BudgetConfig, ["--gpu", "t4", "--batch-size", "1", "--context", "32", "--memory-budget", "64MiB"], "x")
    (row,) = largest_model(cfg.workload, cfg.budget, ladder=(("step in the backward", {"in_backward": True}),), workers=1)
    assert row.precision == "fp32" and "fp32" in row.setting
    train = dataclasses.replace(cfg.workload.train, model=row.model, optim=row.optim, precision=row.precision,
                                activation_checkpointing=row.plan.spec())
    assert "--precision fp32" in train_command(train)


def test_plan_keeps_a_config_files_precision_and_parallel(tmp_path):
    """--precision and (own) --parallel default to the config file's, as every other setting does (before: the
    flags' defaults, auto and ddp, replaced the file's)."""
    from fitgpt.cli.plan import PlanConfig
    from fitgpt.cli.workload import parse_workload

    f = tmp_path / "c.json"
    f.write_text(json.dumps({"precision": "fp32", "parallel": "fsdp"}))
    cfg = parse_workload(PlanConfig, ["--config", str(f), "--gpu", "h100-80gb", "--world-size", "2"], "x")
    assert (cfg.precision, cfg.parallel) == ("fp32", "fsdp")
    assert cfg.workload.dtype is None and cfg.workload.fsdp_ranks == 2
    given = parse_workload(PlanConfig, ["--config", str(f), "--gpu", "h100-80gb", "--precision", "bf16"], "x")
    assert given.precision == "bf16"


def test_largest_model_refuses_an_optimizer_setting_that_would_bend_every_row(capsys):
    for flag in (["--optim.in-backward"], ["--optim.state-dtype", "bf16"], ["--optim.name", "adamw8bit"]):
        code, err = run_cli(["fit", "--largest-model", "--memory-budget", "1GiB", *flag], capsys)
        assert code == 2 and one_line(err) and f"drop {flag[0]}" in err, err


@pytest.mark.slow
def test_auto_config_keeps_a_named_policy_and_plans_the_datas_vocabulary(cli_train_args, tmp_path, monkeypatch, capsys):
    """--activation-checkpointing block with --auto-config trains block (before: none, without a word); the search
    plans the model at the data's vocabulary, 512 here (before: the preset's 2048)."""
    import fitgpt.plan.fastest as fastest

    asked = []
    real = fastest.for_training
    monkeypatch.setattr(fastest, "for_training", lambda cfg: asked.append(cfg) or real(cfg))
    run = tmp_path / "run"
    args = cli_train_args(run, steps=2) + ["--auto-config", "--memory-budget", "30MiB", "--precision", "fp32",
                                           "--activation-checkpointing", "block"]
    assert main(args) == 0
    assert asked[0].model.vocab_size == 512
    assert json.loads((run / "config.json").read_text())["activation_checkpointing"] == "block"


@pytest.mark.parametrize("args", [["plan", "--gpu", ""], ["plan", "--gpu", "l4", "--gpu-memory", ""],
                                  ["plan", "--memory-budget", ""], ["fit", "--memory-budget", "1GiB", "--host-memory", ""],
                                  ["train", "--out-dir", ""], ["prepare", "--dir", " "]])
def test_an_empty_value_is_a_mistake_not_a_flag_left_out(args, tmp_path, monkeypatch, capsys):
    """An unset shell variable (--gpu "$CARD") planned for this CPU, or the card's own memory; (own) trained into
    runs/tiny, prepared into the default folder."""
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(args, capsys)
    assert code == 2 and one_line(err) and "is empty" in err and args[-2] in err
    assert not list(tmp_path.iterdir())


def test_an_offload_plan_is_never_faster_than_keeping_everything():
    """At 100,000 FSDP ranks a block's net bytes past its forward are negative (it frees the padded gathers before
    it): the offload option copied negative bytes, in negative time, and won at 0.194x none's time."""
    from fitgpt.cli.plan import PlanConfig
    from fitgpt.cli.workload import parse_workload

    cfg = parse_workload(PlanConfig, ["--gpu", "h100-80gb", "--world-size", "100000", "--parallel", "fsdp"], "x")
    profile = cfg.workload.profile()
    assert any(b["none"].saved < 0 for b in profile.blocks)
    for b in profile.blocks:
        assert b["offload"].time >= b["none"].time and b["offload"].saved <= max(0, b["none"].saved)


def test_plan_module_counts_registered_buffers():
    big = 64 * 2**20
    plain = plan_module(lambda: Net(), (2, 16), vocab_size=V, gpu="h100-80gb")
    held = plan_module(lambda: Net(buffer=big), (2, 16), vocab_size=V, gpu="h100-80gb")
    assert held.prediction.peak - plain.prediction.peak == big
    assert held.replay["max_allocated"] - plain.replay["max_allocated"] == big


def test_plan_module_buffers_are_measured_as_predicted():
    """On this CPU: a real step of the module with its buffer peaks where the plan says, to the byte."""
    from fitgpt.config import OptimConfig
    from fitgpt.memory.timeline import measure_train_step
    from fitgpt.model.adapter import CausalLM
    from fitgpt.optim import build_optimizer

    p = plan_module(lambda: Net(buffer=2**20), (2, 16), vocab_size=V, precision="fp32")
    model = CausalLM(Net(buffer=2**20))
    apply_activation_checkpointing(model, p.policy)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    batch = [(torch.randint(0, V, (2, 16)), torch.randint(0, V, (2, 16)))]
    measure_train_step(model, opt, batch, grad_clip=1.0)  # the optimizer state exists from here on
    assert measure_train_step(model, opt, batch, grad_clip=1.0).peak == p.prediction.peak


def test_a_refused_apply_leaves_the_earlier_policy_in_place():
    from fitgpt.model.adapter import CausalLM

    model = CausalLM(Net())  # its head is not fitgpt's: no chunked loss
    apply_activation_checkpointing(model, "block")
    wrapped = list(model.model.blocks)
    with pytest.raises(ValueError, match="chunked-loss"):
        apply_activation_checkpointing(model, "selective+chunked-loss")
    assert applied_policy(model).spec == "block" and list(model.model.blocks) == wrapped
    with pytest.raises(UserError):  # (own) a policy for more blocks than there are
        apply_activation_checkpointing(model, "group:7")
    assert applied_policy(model).spec == "block" and list(model.model.blocks) == wrapped


# ---- crashes, hangs, misleading messages ---------------------------------------------------------------

def test_a_model_larger_than_the_machine_is_refused_before_it_is_built(cli_train_args, tmp_path, capsys):
    args = cli_train_args(tmp_path / "run") + ["--model.n-blocks", "200", "--model.n-embed", "4096", "--model.n-head", "32"]
    code, err = run_cli(args, capsys)
    assert code == 2 and one_line(err) and "fp32 weights alone" in err and "fitgpt plan" in err


def test_host_memory_running_out_mid_step_is_named_not_a_traceback(cli_train_args, tmp_path, monkeypatch, capsys):
    """(own) PyTorch's CPU allocator raises a RuntimeError where CUDA raises OutOfMemoryError: the same advice."""
    import fitgpt.train.loop as loop

    def no_memory(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried "
                           "to allocate 40000000000000 bytes")

    monkeypatch.setattr(loop, "train_step", no_memory)
    capsys.readouterr()
    assert main(cli_train_args(tmp_path / "run", steps=2)) == 1
    out = capsys.readouterr()
    assert "out of memory at step" in out.out + out.err and "Traceback" not in out.err


HF = Path(__file__).parent.parent / "benchmarks" / "hf_configs" / "qwen2.5-0.5b.json"


@pytest.mark.parametrize("change, words", [({"num_hidden_layers": "24"}, "num_hidden_layers must be a positive"),
                                           ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive"),
                                           ({"hidden_size": "896"}, "hidden_size must be a positive"),  # (own)
                                           ({"model_type": "mamba", "state_size": 8}, "no attention heads")])
def test_a_hugging_face_config_it_cannot_plan_is_one_line(change, words, tmp_path, capsys):
    pytest.importorskip("transformers")
    values = json.loads(HF.read_text())
    if change.get("model_type") == "mamba":
        values = {"hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 256, "attn_implementation": "eager"}
    f = tmp_path / "config.json"
    f.write_text(json.dumps({**values, **change}))
    code, err = run_cli(["plan", "--hf-config", str(f), "--memory-budget", "4GiB", "--context", "64", "--batch-size", "1"],
                        capsys)
    assert code == 2 and one_line(err) and words in err, err


@pytest.mark.parametrize("kind", ["loss-only", pytest.param("loss-first", marks=pytest.mark.slow)])
def test_plan_module_takes_a_loss_in_any_tuple(kind):
    """(loss,) was an IndexError; (loss, logits) (own; Hugging Face's order) a backward from the logits."""
    p = plan_module(lambda: Net(kind), (2, 16), vocab_size=V)
    assert p.prediction.peak == plan_module(lambda: Net(), (2, 16), vocab_size=V).prediction.peak


@pytest.mark.parametrize("kind, words", [("logits", "no one loss"), ("attribute", r"register_buffer\('scale'")])
def test_plan_module_of_a_module_it_cannot_step_says_what_to_change(kind, words):
    with pytest.raises(UserError, match=words):
        plan_module(lambda: Net(kind), (2, 16), vocab_size=V)


def test_plan_module_without_a_block_list_names_no_argument_it_lacks():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(V, C), nn.Linear(C, V)

        def forward(self, idx, targets):
            return F.cross_entropy(self.head(self.emb(idx)).flatten(0, 1), targets.flatten())

    with pytest.raises(UserError, match="nn.ModuleList") as e:
        plan_module(Flat, (2, 16), vocab_size=V)
    assert "blocks=" not in str(e.value)


@pytest.mark.parametrize("args", [["plan", "--model.n-blocks", "100000"], ["plan", "--context", "10000000"],
                                  ["fit", "--model.n-blocks", "100000"]])  # (own)
def test_weights_over_the_budget_are_refused_before_profiling(args, capsys):
    """Ran past a minute and grew to gigabytes; the weights alone already answer."""
    code, err = run_cli([*args, "--memory-budget", "1GiB"], capsys)
    assert code == 2 and one_line(err) and "the weights alone" in err


def test_fit_over_ranks_refuses_only_weights_no_layout_it_weighs_can_hold():
    """fit --world-size 4 weighs FSDP and tensor parallelism over the 4 ranks: weights over the budget whole (4.1 MiB
    of the tiny preset against 3 MiB) but not a rank's quarter were refused before its search, which names sharding
    over --world-size as the way out. plan keeps the one layout it is given."""
    from fitgpt.cli.fit import FitConfig
    from fitgpt.cli.workload import BudgetConfig

    kw = {"preset": "tiny", "device": "cpu", "memory_budget": "3MiB", "world_size": 4}
    with pytest.raises(UserError, match="the weights alone"):
        BudgetConfig(**kw)  # DDP: every rank holds them whole
    BudgetConfig(**kw, parallel="fsdp")
    FitConfig(**kw)
    with pytest.raises(UserError, match="the weights alone"):
        FitConfig(**{**kw, "memory_budget": "1MiB"})  # over even a quarter of them


def test_fit_over_ranks_says_why_nothing_fits_in_a_ranks_bytes():
    """Where its search over 4 ranks finds nothing, fit explains a rank's share under FSDP over the 4 (1.0 MiB of
    weights) and names more ranks; it explained one process's (4.1 MiB) and named --parallel fsdp, which it had
    weighed already."""
    from fitgpt.cli.fit import FitConfig, say_why_nothing_fits

    with pytest.raises(UserError) as e:
        say_why_nothing_fits(FitConfig(preset="tiny", device="cpu", memory_budget="3MiB", world_size=4))
    msg = str(e.value)
    assert "Parameters (1.0 MiB)" in msg and "over more than 4 GPUs (--world-size)" in msg and "--parallel" not in msg


def test_messages_name_the_flags_given(capsys):
    code, err = run_cli(["plan", "--gpu", "l4", "--gpu-memory", "520MiB"], capsys)
    assert code == 2 and one_line(err) and "--gpu-memory 520MiB" in err and "--memory-budget" not in err
    code, err = run_cli(["bench", "--gpu", "t4"], capsys)
    assert code == 2 and one_line(err) and "fitgpt plan --target/--gpu" in err and "--device measures" not in err


@pytest.mark.parametrize("args, flag", [(["--val-fraction", "0"], "--val-fraction"), (["--vocab-size", "5"], "--vocab-size"),
                                        (["--shard-tokens", "0"], "--shard-tokens"),  # (own)
                                        (["--tokenizer-sample", "0"], "--tokenizer-sample")])  # (own)
def test_prepare_errors_name_prepares_own_flags(args, flag, tmp_path, capsys):
    code, err = run_cli(["prepare", "--dir", str(tmp_path / "d"), *args], capsys)
    assert code == 2 and one_line(err) and flag in err and "--data." not in err, err
    code, err = run_cli(["train", "--out-dir", str(tmp_path / "r"), f"--data.{args[0][2:]}", args[1]], capsys)
    assert code == 2 and one_line(err) and f"--data.{flag[2:]}" in err, err


def _journal(corpus_dir: Path, tmp_path: Path, capsys, damage: str) -> tuple[Path, list[str]]:
    """A preparation cut off after its first checkpoint, its journal (or progress file) garbled."""
    from fitgpt.data.shards import JOURNAL_FILE, PROGRESS_FILE

    d = tmp_path / "d"
    args = ["prepare", "--inputs", str(corpus_dir), "--dir", str(d), "--vocab-size", "300", "--shard-tokens", "2000"]
    cfg = DataConfig(dir=str(d), inputs=(str(corpus_dir),), vocab_size=300, shard_tokens=2000)
    prepare(cfg, progress=False)
    (d / ".partial").mkdir()
    for p in d.iterdir():
        if p.name != ".partial" and p.name != ".fitgpt-lock":
            shutil.move(str(p), d / ".partial" / p.name)
    (d / ".partial" / "meta.json").unlink()
    (d / ".partial" / PROGRESS_FILE).write_text(json.dumps({"journaled": {"shards": {}, "bytes": 10}}))
    (d / ".partial" / JOURNAL_FILE).write_text("{not json\n")
    if damage == "progress":
        (d / ".partial" / PROGRESS_FILE).write_text("[1, 2")
    return d, args


@pytest.mark.parametrize("damage", ["journal", "progress"])  # progress: (own)
def test_prepare_resume_on_a_garbled_journal_names_it_and_discards_nothing(damage, corpus_dir, tmp_path, capsys):
    """It said there was nothing to resume, then that it discarded one, never naming the file."""
    d, args = _journal(corpus_dir, tmp_path, capsys, damage)
    before = snapshot(d)
    code, err = run_cli([*args, "--resume"], capsys)
    name = "journal.jsonl" if damage == "journal" else "progress.json"
    assert code == 2 and one_line(err) and name in err and "without --resume" in err, err
    assert snapshot(d) == before


def test_a_meta_json_that_is_not_fitgpts_is_named(data_dir, tmp_path, capsys):
    d = tmp_path / "d"
    shutil.copytree(data_dir, d)
    (d / "meta.json").write_text("{}")
    code, err = run_cli(["train", "--data.dir", str(d), "--out-dir", str(tmp_path / "r"), "--max-steps", "1"], capsys)
    assert code == 2 and one_line(err) and "meta.json" in err and "data.inputs" not in err


@pytest.mark.parametrize("budget, words", [("1MiB", "the weights alone"), ("14MiB", "alone take")])
def test_fit_with_nothing_that_fits_says_why_and_exits_2(budget, words, capsys):
    """Exit 0 with tables of zeros and no word why; (own) between the weights and the fixed costs too."""
    code, err = run_cli(["fit", "--memory-budget", budget], capsys)
    assert code == 2 and one_line(err) and words in err


# ---- planning that eats the machine ---------------------------------------------------------------------------

def test_a_wide_model_is_timed_on_a_bounded_proxy(monkeypatch):
    """80 x 8192 planned for this CPU timed a real one-block copy: 16 bytes a parameter, 13 GB, for minutes. The
    proxy keeps the head size, MLP ratio and key/value grouping; the rates it gives are per FLOP and per byte."""
    from fitgpt.estimate import timing
    from fitgpt.estimate.source import OwnModel, param_count
    from fitgpt.model import ModelConfig

    for wide in (ModelConfig(n_blocks=80, n_embed=8192, n_head=64, vocab_size=50304, context_length=256),
                 ModelConfig(arch="llama", n_blocks=80, n_embed=8192, n_head=64, n_kv_head=8, ffn_hidden=28672,
                             vocab_size=128256, context_length=256)):
        proxy = timing._small(OwnModel(wide))
        assert param_count(proxy) <= timing.CALIBRATION_PARAMS
        assert proxy.cfg.head_dim == wide.head_dim and proxy.cfg.n_blocks == 1
        assert abs(proxy.cfg.mlp_hidden / proxy.cfg.n_embed - wide.mlp_hidden / wide.n_embed) < 0.1
    monkeypatch.setattr(timing, "CALIBRATION_PARAMS", 2**18)
    rates = timing.calibrate(ModelConfig(n_blocks=4, n_embed=512, n_head=8, vocab_size=512, context_length=64), 2, 64,
                             torch.device("cpu"), None, seconds=0.1)
    assert "a proxy 64 wide for the model's 512" in rates.source
