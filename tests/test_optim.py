"""The optimizer's memory settings: the step inside the backward, bf16 moments, torchao's 8-bit and 4-bit AdamW. Each
is exact where it claims to be, refused where it cannot be, and planned to the byte."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from test_doors import one_line, run_cli
from test_plan import Measured

from fitgpt.cli import main
from fitgpt.config import OptimConfig, load_config
from fitgpt.errors import UserError
from fitgpt.estimate.profile import profile_model
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer, set_lr
from fitgpt.optim.adamw_bf16 import AdamWBf16
from fitgpt.plan import Plan, predict
from fitgpt.plan.family import LADDER
from fitgpt.step import train_step
from fitgpt.train.trainer import train

CPU = torch.device("cpu")


def _steps(model, opt, n=3, seed=1, **kw):
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(n):
        idx = torch.randint(0, model.lm_head.out_features, (4, 17), generator=g)
        set_lr(opt, 1e-3 * (s + 1))  # the schedule reaches every per-parameter optimizer
        out.append(train_step(model, opt, [(idx[:, :-1], idx[:, 1:])], **kw))
    return out


@pytest.mark.parametrize("policy, clip, dropout", [("none", 0.0, 0.0), ("block", 0.0, 0.0), ("none", 0.05, 0.1),
                                                   ("block", 0.05, 0.1)])
def test_the_step_in_the_backward_gives_bitwise_the_weights_of_the_step_after_it(tiny_model_config, policy, clip,
                                                                                  dropout):
    """CPU fp32: the same weights, bit for bit, and the same optimizer state dict (so checkpoints are
    interchangeable); each gradient is gone once its parameter has stepped. Recomputing blocks fire the same hooks.
    With clipping (small enough to act), in two passes: the first's dropout replayed by the second."""
    from fitgpt.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    after = Transformer(tiny_model_config(dropout=dropout))
    inside = copy.deepcopy(after)
    for m in (after, inside):
        apply_activation_checkpointing(m, policy)
    opt_after = build_optimizer(after, OptimConfig(grad_clip=clip), CPU)
    opt_inside = build_optimizer(inside, OptimConfig(grad_clip=clip, in_backward=True), CPU)
    kw = {"grad_clip": clip}
    torch.manual_seed(5)
    ra = _steps(after, opt_after, **kw)
    torch.manual_seed(5)
    ri = _steps(inside, opt_inside, **kw)
    if clip:
        assert min(float(r.grad_norm) for r in ra) > clip  # the clip acted
    for a, b in zip(after.state_dict().values(), inside.state_dict().values()):
        assert torch.equal(a, b)
    assert [float(r.loss) for r in ra] == [float(r.loss) for r in ri]
    assert [float(r.grad_norm) for r in ra] == pytest.approx([float(r.grad_norm) for r in ri], rel=1e-6)
    if clip:  # the first pass's norm is clip_grad_norm_'s
        assert [float(r.grad_norm) for r in ra] == [float(r.grad_norm) for r in ri]
    assert all(p.grad is None for p in inside.parameters())
    sa, si = opt_after.state_dict(), opt_inside.state_dict()
    assert sa["param_groups"] == si["param_groups"] and sa["state"].keys() == si["state"].keys()
    assert all(torch.equal(sa["state"][i][k], si["state"][i][k]) for i in sa["state"] for k in sa["state"][i])


def test_adamw_bf16_keeps_bf16_moments_and_its_first_step_is_pytorchs(tiny_model_config):
    """The update is computed in fp32 from the moments before they are rounded: a first step gives PyTorch's AdamW
    weights bit for bit, with the moments PyTorch's rounded to bf16."""
    torch.manual_seed(0)
    ref = Transformer(tiny_model_config())
    low = copy.deepcopy(ref)
    opt_ref = build_optimizer(ref, OptimConfig(grad_clip=0), CPU)
    opt_low = build_optimizer(low, OptimConfig(grad_clip=0, state_dtype="bf16"), CPU)
    assert isinstance(opt_low, AdamWBf16)
    _steps(ref, opt_ref, n=1), _steps(low, opt_low, n=1)
    for a, b in zip(ref.state_dict().values(), low.state_dict().values()):
        assert torch.equal(a, b)
    for p_ref, p_low in zip(ref.parameters(), low.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert opt_low.state[p_low][k].dtype == torch.bfloat16
            assert torch.equal(opt_low.state[p_low][k], opt_ref.state[p_ref][k].to(torch.bfloat16))
    # An fp32-moment state (a checkpoint of a plain run) loads into it, rounded.
    opt_low.load_state_dict(opt_ref.state_dict())
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in opt_low.state.values())


OPTIMS = {
    "adamw": OptimConfig(grad_clip=0),
    "in-backward": OptimConfig(grad_clip=0, in_backward=True),
    "in-backward, clipped": OptimConfig(in_backward=True),  # two passes
    "bf16": OptimConfig(grad_clip=0, state_dtype="bf16"),
    "bf16+in-backward": OptimConfig(grad_clip=0, state_dtype="bf16", in_backward=True),
    "8bit+in-backward": OptimConfig(grad_clip=0, name="adamw8bit", in_backward=True),
    "adafactor": OptimConfig(name="adafactor"),  # clipping on: the step after the backward
    "adafactor+in-backward": OptimConfig(grad_clip=0, name="adafactor", in_backward=True),
}
LOW_BIT = {
    "8bit": OptimConfig(name="adamw8bit"),  # clipping on: the step after the backward
    "4bit+in-backward": OptimConfig(grad_clip=0, name="adamw4bit", in_backward=True),
}


@pytest.mark.parametrize("name", ["in-backward, clipped", *(pytest.param(n, marks=pytest.mark.slow) for n in (
    "in-backward", "bf16+in-backward", "adafactor", "adafactor+in-backward", *LOW_BIT))])
def test_each_optimizer_setting_is_planned_to_the_byte(tiny_model_config, name):
    """The plan profiles the optimizer the trainer builds: a real step's peak is the predicted one under none and
    block, on a model deep enough to be profiled shallow and deepened (the step inside the backward runs in the
    shallow profile's blocks). 64 wide, so that torchao quantizes the matrices' moments (4096 values and more)."""
    cfg = tiny_model_config(n_blocks=6, n_embed=64)
    optim = {**OPTIMS, **LOW_BIT}[name]
    profile = profile_model(cfg, 2, 16, "cpu", optim, fake=True)
    assert profile.passes == (2 if optim.in_backward and optim.grad_clip else 1)  # the time model runs both
    measured = Measured(cfg, batch=2, context=16, optim=optim)
    for option in ("none", "block"):
        plan = Plan.uniform(cfg.n_blocks, option)
        assert measured.peak(plan) == predict(profile, plan).peak, (name, option)


@pytest.mark.slow
def test_bytes_per_parameter_at_the_peak():
    """A model whose parameters dominate (batch 1 x 16): the peak per parameter falls from 16 by the gradients (4)
    and the moments' halving (4), measured on real steps, and each is the predicted peak."""
    cfg = ModelConfig(vocab_size=512, context_length=16, n_embed=256, n_head=4, n_blocks=4, dropout=0.0)
    held = {}
    for name, optim in OPTIMS.items():
        m = Measured(cfg, batch=1, context=16, optim=optim)
        n = sum(p.numel() for p in m.model.parameters())
        plan = Plan.uniform(cfg.n_blocks, "none")
        pred = predict(profile_model(cfg, 1, 16, "cpu", optim, fake=True), plan)
        assert m.peak(plan) == pred.peak, name
        held[name] = (pred.params + pred.grads + pred.optimizer) / n
    assert held["adamw"] == pytest.approx(16, abs=0.01)
    assert held["in-backward"] < 12.2 and held["bf16"] == pytest.approx(12, abs=0.01)
    assert held["bf16+in-backward"] < 8.2
    assert held["8bit+in-backward"] < 6.3  # 1 byte a moment, a 4-byte scale per 256, the largest gradient
    assert held["adafactor+in-backward"] < 4.3  # a row and a column per matrix, the largest gradient


def test_low_bit_optimizers_say_where_they_run(monkeypatch):
    from fitgpt.optim.lowbit import low_bit_adamw

    groups = [{"params": [torch.nn.Parameter(torch.zeros(64, 64))]}]
    with pytest.raises(UserError, match="runs on CUDA and the CPU .*not mps: use --optim.name adamw"):
        low_bit_adamw("adamw8bit", groups, 1e-3, (0.9, 0.95), torch.device("mps"))
    monkeypatch.setitem(__import__("sys").modules, "torchao.optim", None)
    with pytest.raises(UserError, match=r"needs torchao: pip install 'fitgpt\[lowbit\]'"):
        low_bit_adamw("adamw4bit", groups, 1e-3, (0.9, 0.95), torch.device("cpu"))


@pytest.mark.parametrize("overrides, flag", [
    ({"optim": {"in_backward": True, "grad_clip": 0}, "grad_accum": 2}, "--grad-accum 1"),
    ({"optim": {"in_backward": True, "grad_clip": 0}, "precision": "fp16"}, "--precision bf16"),
    ({"optim": {"in_backward": True, "grad_clip": 0}, "max_bad_steps": 2}, "--max-bad-steps 0"),
    ({"optim": {"state_dtype": "bf16", "impl": "fused"}}, "drop --optim.impl fused"),
    ({"optim": {"state_dtype": "bf16", "name": "adamw8bit"}}, "keeps its own state"),
    ({"optim": {"impl": "foreach", "name": "adamw4bit"}}, "drop --optim.impl"),
])
def test_what_a_step_in_the_backward_cannot_do_is_refused_naming_the_flag(overrides, flag):
    with pytest.raises(UserError, match=flag.replace("+", r"\+")):
        load_config("tiny", overrides=overrides)


def test_the_commands_refuse_in_one_line(capsys):
    assert main(["plan", "--preset", "tiny", "--optim.in-backward", "--optim.grad-clip", "0", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "one process" in err and len(err.strip().splitlines()) == 1


def test_training_inside_the_backward_resumes_from_and_into_a_plain_run(make_cfg, tmp_path):
    """The trainer with the step inside the backward trains the weights the plain step trains, bit for bit (no
    dropout, no clipping), and each run's checkpoint resumes under the other setting."""
    model = {"context_length": 32, "n_embed": 32, "n_head": 4, "n_blocks": 2, "dropout": 0.0}
    kw = {"max_steps": 4, "checkpoint_interval": 2, "model": model}
    runs = {}
    for name, optim in (("plain", {"grad_clip": 0}), ("inside", {"grad_clip": 0, "in_backward": True})):
        train(make_cfg(tmp_path / name, optim=optim, **kw))
        runs[name] = load_file(str(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors"))
    for k in runs["plain"]:
        assert torch.equal(runs["plain"][k], runs["inside"][k]), k
    # Steps 3-4 again from step 2 of the other setting's run.
    for name, optim in (("plain", {"grad_clip": 0, "in_backward": True}), ("inside", {"grad_clip": 0})):
        cfg = make_cfg(tmp_path / name, optim=optim, resume=str(tmp_path / name / "checkpoints" / "step_00000002"), **kw)
        train(cfg)
        again = load_file(str(tmp_path / name / "checkpoints" / "step_00000004" / "model.safetensors"))
        for k in runs["plain"]:
            assert torch.equal(runs["plain"][k], again[k]), (name, k)


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_low_bit_adamw_checkpoints_plain_moments_and_resumes_exactly(name, make_cfg, tmp_path):
    """The trainer's schedule reaches torchao's tensor learning rates (a float there would stop its step); the
    checkpoint holds the moments as plain fp32 tensors that load with weights_only into AdamW (close), and beside
    them the quantized codes and scales, so that the same optimizer resumes bitwise (before: quantized a second
    time, the final weights differed by up to 1.1e-3 with 8 bits, 9.2e-3 with 4)."""
    model = {"context_length": 32, "n_embed": 64, "n_head": 4, "n_blocks": 2, "dropout": 0.0}
    kw = {"max_steps": 4, "checkpoint_interval": 2, "model": model}
    summary = train(make_cfg(tmp_path / "low", optim={"name": name}, **kw))
    assert summary["steps"] == 4
    state = torch.load(tmp_path / "low" / "checkpoints" / "step_00000002" / "state.pt", weights_only=True)
    moments = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
    assert all(type(m) is torch.Tensor and m.dtype == torch.float32 for m in moments)
    assert state["optimizer"]["lowbit_exact"]  # the quantized moments, as they were
    first = load_file(str(tmp_path / "low" / "checkpoints" / "step_00000004" / "model.safetensors"))
    for optim in ({"name": name}, {}):
        train(make_cfg(tmp_path / "low", optim=optim, resume=str(tmp_path / "low" / "checkpoints" / "step_00000002"), **kw))
        again = load_file(str(tmp_path / "low" / "checkpoints" / "step_00000004" / "model.safetensors"))
        for k in first:
            if optim:
                assert torch.equal(again[k], first[k]), k
            else:
                torch.testing.assert_close(again[k], first[k], rtol=0, atol=2e-3)


@pytest.mark.slow
def test_the_largest_model_fits_in_a_real_step_and_one_block_deeper_does_not():
    """fit --largest-model, scaled down to this CPU: the model it names for a setting, trained one real step under
    its plan and optimizer, peaks within the budget; the model one block deeper (and as much wider as the shape
    says), under the plan that needs least memory, does not. Both peaks are the planned ones, to the byte."""
    from fitgpt.cli.workload import BudgetConfig
    from fitgpt.plan import min_peak
    from fitgpt.plan.family import LADDER, largest_model, scaled

    flags = BudgetConfig(preset="tiny", batch_size=2, context=32, grad_accum=1, memory_budget="20MiB")
    w, budget = flags.workload, flags.budget
    (row,) = largest_model(w, budget, ladder=LADDER[2:3])  # bf16 moments, the step in the backward
    assert row.model.n_blocks > 4  # the budget leaves room beyond the preset's depth
    deeper = scaled(w.train.model, row.model.n_blocks + 1)
    plan_deeper, _ = min_peak(w.vary(model=deeper, optim=row.optim, grad_accum=1).profile())
    for cfg, plan, fits in ((row.model, row.plan, True), (deeper, plan_deeper, False)):
        measured = Measured(cfg, batch=2, context=32, optim=row.optim).peak(plan)
        predicted = predict(w.vary(model=cfg, optim=row.optim, grad_accum=1).profile(), plan).peak
        assert measured == predicted
        assert (measured <= budget) == fits, (cfg.n_blocks, measured, budget)


@pytest.mark.slow
def test_fit_largest_model_prints_each_setting_and_the_command(capsys):
    assert main(["fit", "--preset", "tiny", "--largest-model", "--gpu", "rtx-4090", "--memory-budget", "30MiB",
                 "--batch-size", "1", "--context", "16", "--grad-accum", "1"]) == 0
    out = capsys.readouterr().out
    for setting in ("| AdamW |", "bf16 moments |", "step in the backward |", "8-bit AdamW, step in the backward |",
                    "4-bit AdamW, step in the backward |", "Adafactor, step in the backward |",
                    "Adafactor, bf16 weights (stochastic rounding), step in the backward |",
                    "APOLLO-Mini, bf16 weights (stochastic rounding), step in the backward |",
                    "AdamW on the host, each gradient freed once copied |"):
        assert setting in out
    rows = json.loads(out.strip().splitlines()[-1])["rows"]
    host, adamw = rows[-1], [r for r in rows[:-1] if r["setting"].startswith(("AdamW", "8-bit", "4-bit"))]
    assert host["host_bytes"] > 0 and all(r["host_bytes"] == 0 for r in rows[:-1])
    assert host["params"] > max(r["params"] for r in adamw)  # 4 bytes a parameter on the card
    bf16 = [r for r in rows if "bf16 weights" in r["setting"]]  # weights and gradients in 2 bytes: the largest of all
    assert len(bf16) == 2 and max(r["params"] for r in bf16) == max(r["params"] for r in rows)
    assert all(r["val_loss_vs_adamw"] for r in rows)  # each row's measured cost in loss
    assert "train the largest: fitgpt train --preset tiny" in out and "--model.weights-dtype bf16" in out
    assert main(["fit", "--preset", "tiny", "--largest-model", "--memory-budget", "12MiB", "--world-size", "2"]) == 2
    assert "add --parallel fsdp" in capsys.readouterr().err  # DDP's ranks each hold what one card does


@pytest.mark.slow
def test_fit_largest_model_over_fsdp_ranks_shows_every_setting_each_rank_trains(capsys, monkeypatch):
    """--largest-model --world-size 2 --parallel fsdp (once refused: "answers for one card"): a row for each setting
    as the ranks train it (the step in the backward on each rank's shards, or on each whole matrix's owner), each
    rank's share of the state; the whole-matrix optimizers and bf16 weights beyond AdamW, as on one card. One rung of
    each kind the ranks search differently (AdamW's shards, its shards stepped in the backward, a whole-matrix step in
    the backward, and that over bf16 weights): every rung of the ladder is searched on one card in the test above."""
    from fitgpt.plan import family

    monkeypatch.setattr(family, "LADDER", tuple(LADDER[i] for i in (0, 2, 3, 6)))
    assert main(["fit", "--preset", "tiny", "--largest-model", "--gpu", "rtx-4090", "--memory-budget", "30MiB",
                 "--batch-size", "1", "--context", "16", "--world-size", "2", "--parallel", "fsdp",
                 "--grad-accum", "4"]) == 0  # as llama-1b's preset accumulates: the rungs are searched without
    out = capsys.readouterr().out
    rows = {r["setting"]: r for r in json.loads(out.strip().splitlines()[-1])["rows"]}
    assert list(rows) == [name for name, _ in family.LADDER]
    assert all(r["params"] for r in rows.values())
    assert rows["Adafactor, bf16 weights (stochastic rounding), step in the backward"]["params"] > 1.5 * rows["AdamW"]["params"]
    assert "--parallel fsdp" in out.splitlines()[-2]  # the command trains the largest on the ranks
    assert out.splitlines()[-2].startswith("train the largest: torchrun --nproc-per-node 2 -m fitgpt train")


@pytest.mark.slow
def test_the_largest_model_over_fsdp_and_tensor_parallel_ranks_splits_its_heads_evenly():
    """FSDP 2 x TP 2: each size searched has whole heads for each tensor-parallel rank (tiny's width per block would
    give 7 heads at 7 blocks, which TP 2 refuses), and the largest is planned within the budget."""
    from fitgpt.cli.workload import BudgetConfig
    from fitgpt.plan.family import largest_model

    flags = BudgetConfig(preset="tiny", batch_size=1, context=16, grad_accum=1, memory_budget="24MiB", gpu="rtx-4090",
                         world_size=4, parallel="fsdp", tensor_parallel=2)
    (row,) = largest_model(flags.workload, flags.budget, ladder=(("Muon", {"name": "muon"}),))
    assert row.model.n_head % 2 == 0 and row.model.n_blocks > 2 and row.prediction.peak <= flags.budget


def test_fit_takes_tensor_parallel_for_the_largest_model_only(capsys):
    code, err = run_cli(["fit", "--preset", "tiny", "--memory-budget", "1GiB", "--tensor-parallel", "2"], capsys)
    assert code == 2 and one_line(err) and "fit searches the tensor-parallel degree itself" in err


def test_a_bad_step_in_the_backward_stops_the_run_and_saves_nothing(make_cfg, tmp_path, nan_model):
    """Applied before it is known to be bad: the run stops at the first read, says why it could not skip, and writes
    no checkpoint of the poisoned weights."""
    from fitgpt.train.loop import TrainingError

    with pytest.raises(TrainingError, match="with --optim.in-backward a bad step is applied before it is known"):
        train(make_cfg(tmp_path / "run", optim={"in_backward": True}, log_interval=4, eval_interval=5,
                       checkpoint_interval=3))
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def test_the_step_in_the_backward_saves_an_empty_group_with_its_own_settings():
    """A model with no vectors (no biases, no norms) leaves the no-decay group empty: its saved settings are its
    own, not the group before's (before the fix it repeated weight_decay 0.1)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    sd = build_optimizer(model, OptimConfig(grad_clip=0, in_backward=True), CPU).state_dict()
    assert [g["weight_decay"] for g in sd["param_groups"]] == [0.1, 0.0]
    assert [g["params"] for g in sd["param_groups"]] == [[0], []]


@pytest.mark.parametrize("overrides", [{"n_blocks": 7}, {"n_blocks": 5, "arch": "llama", "n_kv_head": 2},
                                       {"n_blocks": 3, "bias": False, "tie_embeddings": False}])
def test_the_searches_count_a_deep_model_as_built(tiny_model_config, overrides):
    """param_count counts fitgpt's models from their one- and two-block models: the count of the model built."""
    from fitgpt.estimate.source import OwnModel, param_count

    cfg = tiny_model_config(**overrides)
    model = Transformer(cfg)
    assert param_count(OwnModel(cfg)) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
