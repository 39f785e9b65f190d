"""Planning models fitgpt does not train: Hugging Face causal LMs from their config alone (`fitgpt plan --hf-config`)
and any module (`fitgpt.plan.plan_module`). Each prediction is checked against a real step of the same model on CPU,
byte for byte, for every option on every block and for mixed plans."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.cli import main
from fitgpt.cli.workload import BudgetConfig
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.profile import BLOCK_OPTIONS, profile_model
from fitgpt.estimate.source import HFModel, ModuleModel, read_hf_config
from fitgpt.memory.timeline import measure_train_step
from fitgpt.optim import build_optimizer
from fitgpt.plan import Plan, plan_module, predict, solve, solve_exhaustive
from fitgpt.plan.solver import _cost

transformers = pytest.importorskip("transformers")
B, T, V = 2, 64, 512
SMALL = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
         "max_position_embeddings": 128}


def real_peaks(source, plans: list[Plan], dtype=None) -> list[int]:
    """The shared train_step's measured peak of each plan on CPU, in the trainer's steady state."""
    torch.manual_seed(0)
    model = source.build()
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
    idx = torch.randint(0, source.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    batches = [(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())]
    kw = {"amp": autocast(torch.device("cpu"), dtype)}
    measure_train_step(model, opt, batches, **kw)  # the optimizer state exists from here on
    peaks = []
    for plan in plans:
        apply_activation_checkpointing(model, plan.spec())
        peaks.append(measure_train_step(model, opt, batches, **kw).peak)
        remove_activation_checkpointing(model)
    return peaks


def hf(kind: str, attention: str, **extra) -> HFModel:
    config = transformers.AutoConfig.for_model(kind, **SMALL, **extra)
    config._attn_implementation = attention
    return HFModel(config)


PLANS = [Plan.uniform(3, o) for o in BLOCK_OPTIONS] + [Plan(("none", "block", "none")), Plan(("selective", "none", "pointwise"))]


@pytest.mark.parametrize("kind, attention, dtype, extra", [
    ("qwen2", "sdpa", None, {"num_key_value_heads": 2}),
    ("mistral", "eager", torch.bfloat16, {"num_key_value_heads": 2}),
    ("gpt_neox", "sdpa", torch.bfloat16, {}),
])
@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_hf_models_planned_from_their_config_equal_a_real_step(kind, attention, dtype, extra):
    source = hf(kind, attention, **extra)
    profile = profile_model(source, B, T, "cpu", fake=True, dtype=dtype)
    predicted = [predict(profile, plan).peak for plan in PLANS]
    assert predicted == real_peaks(source, PLANS, dtype)
    assert "chunked" not in profile.heads  # their heads compute their own loss: no chunked loss offered


@pytest.mark.slow
def test_shared_inputs_held_by_the_first_recomputing_block():
    """An eager HF model builds a (B, 1, T, T) mask before its blocks: freed as the forward ends when nothing
    recomputes, held by a checkpoint until its backward otherwise. Every mixed plan is exact, and the dynamic
    programme still finds the exhaustive search's plan."""
    source = hf("qwen2", "eager", num_key_value_heads=2)
    profile = profile_model(source, B, T, "cpu", fake=True)
    assert profile.shared_inputs >= B * T * T * 4  # the fp32 mask, and the position ids
    plans = [Plan(opts) for opts in itertools.product(("none", "selective", "block"), repeat=3)]
    assert [predict(profile, p).peak for p in plans] == real_peaks(source, plans)
    lo, hi = predict(profile, Plan.uniform(3, "block")).peak, predict(profile, Plan.uniform(3, "none")).peak
    for k in range(11):
        budget = lo + (hi - lo) * k // 10
        best, (plan, pred) = solve_exhaustive(profile, budget), solve(profile, budget)
        assert pred.peak <= budget and _cost(profile, plan) == _cost(profile, best[0])


class NanoAttention(nn.Module):
    """nanoGPT's attention without flash: the mask a buffer, softmax written out."""

    def __init__(self, c: int, heads: int, context: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(c, 3 * c), nn.Linear(c, c)
        self.register_buffer("bias", torch.tril(torch.ones(context, context)).view(1, 1, context, context))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, T)
        att = F.softmax(att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")), dim=-1)
        return self.proj((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class NanoBlock(nn.Module):
    def __init__(self, c: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.attn = NanoAttention(c, heads, context)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = V, c: int = 64, heads: int = 4, context: int = T, n: int = 3) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, c), nn.Embedding(context, c)
        self.h = nn.ModuleList(NanoBlock(c, heads, context) for _ in range(n))
        self.ln_f, self.lm_head = nn.LayerNorm(c), nn.Linear(c, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@pytest.mark.parametrize("precision, dtype", [("fp32", None), pytest.param("bf16", torch.bfloat16, marks=pytest.mark.slow)])
def test_plan_module_of_a_hand_written_eager_model_equals_a_real_step(precision, dtype):
    result = plan_module(NanoGPT, (B, T), vocab_size=V, precision=precision)
    profile = result.profile
    plans = PLANS + [Plan.from_policy(result.policy, 3)[0]]
    assert [predict(profile, p).peak for p in plans] == real_peaks(ModuleModel(NanoGPT, V, T, 3), plans, dtype)
    assert result.budget is None and result.prediction.peak <= min(result.uniform.values())  # no budget: the lowest peak
    assert result.replay is None  # a CPU plan: no CUDA allocator to replay


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_module_for_a_card_solves_within_its_budget_and_replays_the_allocator():
    card = plan_module(NanoGPT, (B, T), vocab_size=V, gpu="a100-80gb")  # the card's memory: none fits, the fastest
    assert card.policy == "none"
    replay = card.replay  # the allocator's blocks hold at least the tensors, and the segments at least the blocks
    assert replay["max_allocated"] >= card.prediction.peak and replay["max_reserved"] >= replay["max_allocated"]
    workspaces = Target("cuda", find_gpu("a100-80gb")).workspace_bytes()
    result = plan_module(NanoGPT, (B, T), vocab_size=V, gpu="a100-80gb", budget=card.uniform["none"] - 1 + workspaces)
    assert result.fits and result.policy != "none"  # none is one byte over: something recomputes or offloads


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_plan_command_takes_a_hugging_face_config(tmp_path, capsys):
    hf("qwen2", "sdpa", num_key_value_heads=2).config.save_pretrained(tmp_path / "qwen")
    assert main(["plan", "--hf-config", str(tmp_path / "qwen"), "--batch-size", "2", "--context", "64",
                 "--memory-budget", "3600000B"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Qwen2 (sdpa attention), 3 blocks x 64 wide, 4 heads (2 kv), vocab 512")
    assert "block+chunked-loss" not in out and "in your training loop: apply_activation_checkpointing(model, '" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["fits_budget"] and result["policy"] != "none"
    # what it says about the policy it chose is what a real step of that model measures
    assert result["predicted_peak"] == real_peaks(read_hf_config(tmp_path / "qwen"), [Plan.from_policy(result["policy"], 3)[0]])[0]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read a config.json there"),
    ('{"model_type": "no-such-model"}', "model_type 'no-such-model' is not one transformers"),
    ('{"model_type": "vit"}', "has no causal LM"),
    (json.dumps({"model_type": "qwen2", **SMALL, "attn_implementation": "flash_attention_2"}), "cannot build this model here"),
])
def test_hf_config_errors_are_one_line(tmp_path, capsys, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    assert main(["plan", "--hf-config", str(path), "--memory-budget", "1GiB"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_model_flags_do_not_shape_a_hugging_face_model(tmp_path, capsys):
    hf("qwen2", "sdpa").config.save_pretrained(tmp_path)
    assert main(["plan", "--hf-config", str(tmp_path), "--model.n-blocks", "8", "--memory-budget", "1GiB"]) == 2
    assert "--model.* flags shape fitgpt's own model" in capsys.readouterr().err
    # nor does the chunked loss apply to it (before: a KeyError from the profile's heads)
    for command in ("plan", "fit"):
        args = [command, "--hf-config", str(tmp_path), "--memory-budget", "1GiB", "--activation-checkpointing", "block+chunked-loss"]
        assert main(args) == 2
        assert "drop '+chunked-loss'" in capsys.readouterr().err


@pytest.mark.slow
def test_a_deep_hf_model_is_profiled_shallow_and_deepened_exactly(monkeypatch):
    """Eight blocks or more: profiled at four and deepened, as fitgpt's own (every field equal to profiling all)."""
    import fitgpt.estimate.profile as profile_module

    source = hf("qwen2", "sdpa", num_key_value_heads=2).at(n_blocks=profile_module.DEEP)
    deep = profile_model(source, B, T, "cpu", fake=True, dtype=torch.bfloat16)
    monkeypatch.setattr(profile_module, "DEEP", 100)
    every = profile_model(source, B, T, "cpu", fake=True, dtype=torch.bfloat16)
    fields = [f.name for f in dataclasses.fields(deep) if f.name != "seconds"]
    assert [getattr(deep, f) for f in fields] == [getattr(every, f) for f in fields]


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_hf_model_per_fsdp_rank_on_fake_tensors_equals_real_ones():
    """One rank of two under FSDP2 (sharded as the trainer shards, on fake ranks): the fake profile of a Hugging Face
    model equals the profile of the same step on real tensors, field by field, in bf16 (pure bf16 under FSDP)."""
    source = hf("qwen2", "eager", num_key_value_heads=2)
    real, fake = (profile_model(source, B, T, "cpu", fake=f, dtype=torch.bfloat16, fsdp_ranks=2) for f in (False, True))
    fields = [f.name for f in dataclasses.fields(real) if f.name != "seconds"]
    assert [getattr(fake, f) for f in fields] == [getattr(real, f) for f in fields]
    assert real.fsdp_ranks == 2 and real.shared_inputs > 0


def test_the_line_for_your_own_loop_names_how_fsdp_shards(tmp_path):
    """What a Hugging Face model's plan tells its user to run: the policy, and under FSDP the sharding and mixed
    precision the plan was made for (as fitgpt.parallel shards), not a fitgpt train command it cannot run."""
    hf("qwen2", "sdpa").config.save_pretrained(tmp_path)
    w = BudgetConfig(hf_config=str(tmp_path), world_size=4, parallel="fsdp", gpu="h100-80gb", precision="bf16").workload
    line = w.how_to_train(dataclasses.replace(w.train, activation_checkpointing="block"))
    assert line.startswith("in your training loop: apply_activation_checkpointing(model, 'block')")
    assert "FSDP2 over 4 ranks" in line and "MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), no autocast" in line
    assert "fitgpt train" not in line


# ---- one rank of many (issue 38, item 5) -----------------------------------------------------------

RANK_OPTIONS = ("none", "block", "selective")


def _measured_peaks(rank: int, world: int) -> dict:
    """Each rank's measured peak (the tracker, at its second step) of the hand-written NanoGPT, FSDP and DDP."""
    from fitgpt.parallel.data import sync_context
    from fitgpt.train import distributed as du

    info = du.init_distributed("cpu", timeout_s=120)  # the pool's group, already joined
    cpu, rows = torch.device("cpu"), {}
    x = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(rank))
    for parallel in ("fsdp", "ddp"):
        for option in RANK_OPTIONS:
            torch.manual_seed(0)
            model = NanoGPT()
            apply_activation_checkpointing(model, option)
            step_model = du.wrap(model, info, parallel, cpu, None)
            opt = build_optimizer(model, OptimConfig(), cpu)
            kw = {"sync": lambda last, m=step_model: sync_context(m, last), "grad_clip": OptimConfig().grad_clip}
            measure_train_step(step_model, opt, [(x, x)], **kw)  # the optimizer state exists from here on
            rows[parallel, option] = measure_train_step(step_model, opt, [(x, x)], **kw).peak
    return rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_module_plans_one_rank_under_fsdp_and_ddp_as_two_real_ranks_measure(tmp_path, ranks):
    """A hand-written module planned with world_size=2: each rank's measured peak on 2 gloo CPU ranks equals the
    per-rank prediction to the byte, every option (main: plan_module had no world size)."""
    measuring = ranks(2).submit(_measured_peaks)  # the ranks measure while this process plans
    plans = {parallel: plan_module(NanoGPT, (B, T), vocab_size=V, precision="fp32", world_size=2, parallel=parallel,
                                   snapshot=tmp_path / f"{parallel}.pickle") for parallel in ("fsdp", "ddp")}
    measured = measuring.result()
    for parallel, plan in plans.items():
        for option in RANK_OPTIONS:
            assert measured[0][parallel, option] == measured[1][parallel, option] == plan.uniform[option], (parallel, option)
        assert (tmp_path / f"{parallel}.pickle").stat().st_size > 0
    assert plan_module(NanoGPT, (B, T), vocab_size=V, precision="fp32").uniform["none"] > measured[0]["fsdp", "none"]
