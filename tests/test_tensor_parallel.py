"""Tensor and sequence parallelism (issue 45): fitgpt's Llama and GPT-2 split over gloo CPU ranks with PyTorch's own
tensor parallelism give one process's loss and gradients within fp32 rounding, under the checkpointing policies,
with grouped-query attention; each rank is planned to the byte; what cannot be split is refused in one line.
(Through the trainer and torchrun: test_tensor_parallel_runs.py.)"""

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.model import ModelConfig, Transformer
from fitgpt.parallel.tensor import apply_tensor_parallel, launch_refusal, step_context, tensor_parallel_refusal

# Llama with grouped-query attention (8 query heads sharing 4 key/value heads), untied, no dropout.
CFG = ModelConfig(arch="llama", vocab_size=128, context_length=16, n_embed=64, n_head=8, n_kv_head=4, n_blocks=2,
                  dropout=0.0, tie_embeddings=False)
# GPT-2's block (one query/key/value matrix, biases, learned positions), untied, no dropout.
GPT2 = ModelConfig(arch="gpt2", vocab_size=128, context_length=16, n_embed=64, n_head=8, n_blocks=2, dropout=0.0,
                   tie_embeddings=False, bias=True)
CFGS = {"llama": CFG, "gpt2": GPT2}
# The loss heads too: chunks of 8 of a batch's 32 tokens (16 under 2 x 2), each chunk's logits sharded on the vocabulary.
POLICIES = ["none", "block", "selective", "pointwise", "chunked-loss:8", "selective+fused-loss:8"]


def _batch():
    idx = torch.randint(0, CFG.vocab_size, (2, CFG.context_length + 1), generator=torch.Generator().manual_seed(1))
    return idx[:, :-1], idx[:, 1:]


def _grads(model):
    """Each parameter's gradient, gathered whole (a collective under tensor parallelism)."""
    from fitgpt.parallel.placement import gather_whole

    return {n: gather_whole(p.grad) for n, p in model.named_parameters()}


def _one_process(arch: str, spec: str, bf16: bool) -> tuple[torch.Tensor, dict]:
    """One process's step of the batch under ``spec`` (in bf16 autocast where asked): its loss and gradients."""
    torch.manual_seed(0)
    model = Transformer(CFGS[arch])
    apply_activation_checkpointing(model, spec)
    x, y = _batch()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        loss = model(x, y)[1]
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _equal_steps(rank: int, world: int, tp: int, arch: str) -> dict | None:
    """One step of every policy on the (world / tp) x tp mesh: the loss and every gradient, gathered whole (rank 0's;
    None elsewhere), and the rows of the first query projection a rank holds (GPT-2's: of its query, key and value)."""
    from fitgpt.parallel.fsdp import fsdp_shard
    from fitgpt.parallel.tensor import training_mesh

    mesh = training_mesh("cpu", world, tp)
    dp, dp_rank = world // tp, mesh["dp"].get_local_rank()
    x, y = (t[dp_rank::dp] for t in _batch())  # each data-parallel rank its rows; FSDP averages their gradients
    results = {}
    for spec in POLICIES:
        torch.manual_seed(0)
        model = Transformer(CFGS[arch])  # whole on every rank, the same weights; each keeps its shards
        apply_tensor_parallel(model, mesh["tp"])
        attn = model.attn_blocks[0].attn
        q_rows = (attn.q_proj if arch == "llama" else attn.qkv).weight.to_local().shape[0]
        apply_activation_checkpointing(model, spec)  # after the split, as torchtitan orders them
        if dp > 1:
            fsdp_shard(model, None, mesh=mesh["dp"])
        with step_context(model):
            loss = model(x, y)[1]
            loss.backward()
        loss = loss.detach()
        dist.all_reduce(loss, group=mesh["dp"].get_group())  # the whole batch's mean (equal rows per rank)
        results[spec] = {"loss": loss / dp, "grads": _grads(model), "q_rows": q_rows}  # whole on every rank
    return results if rank == 0 else None


@pytest.mark.slow
# TP 4 leaves each rank one of Llama's 4 key/value heads, the edge of grouped queries; GPT-2's heads split by 4 as by 2
@pytest.mark.parametrize("world, tp, arch", [(2, 2, "llama"), (4, 2, "llama"), (4, 4, "llama"), (2, 2, "gpt2"),
                                             (4, 2, "gpt2")])
def test_tensor_parallel_equals_one_process(world, tp, arch, ranks):
    """1 x 2, 2 x 2 (FSDP over the data-parallel pair, each its half of the batch) and 1 x 4 (each rank 8 / tp query
    heads and 4 / tp key/value heads), every policy in one launch: the loss and every gradient within fp32 rounding of
    one process's, each rank holding 1 / tp of each projection. GPT-2's block too (once refused: "not split by heads
    yet"): each rank the rows of its heads in each third of the one query/key/value matrix, and under 2 x 2 FSDP's
    half of those (once refused: "without --parallel fsdp")."""
    results = ranks(world).run(_equal_steps, tp, arch)[0]
    for spec in POLICIES:
        loss, grads = _one_process(arch, spec, bf16=False)
        got = results[spec]
        assert got["q_rows"] == (1 if arch == "llama" else 3) * CFGS[arch].n_embed // tp
        torch.testing.assert_close(got["loss"], loss, rtol=1e-6, atol=0)
        for name, g in grads.items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-7, msg=f"{spec} {name}")


def _compiled_and_in_bf16(rank: int, world: int, tp: int, arch: str, cases: tuple) -> dict | None:
    """One step of each of ``cases`` (policy, --compile, bf16) through the trainer's `prepare_model` (the split,
    checkpointing, each block compiled where asked, FSDP over the data-parallel ranks where world > tp): the loss and
    every gradient, gathered whole (rank 0's; None elsewhere). bf16 under autocast, as the trainer runs the split."""
    from fitgpt.config import TrainConfig
    from fitgpt.train import distributed as du
    from fitgpt.train.setup import prepare_model

    torch._dynamo.reset()  # the pool's ranks outlive a test: no compiled code, or cache limit, from an earlier one
    info = du.init_distributed("cpu", 300)  # the pool's group, already joined
    dp = world // tp
    x, y = (t[rank // tp::dp] for t in _batch())
    results = {}
    for spec, compile, bf16 in cases:
        cfg = TrainConfig(model=CFGS[arch], tensor_parallel=tp, parallel="fsdp" if dp > 1 else "ddp", compile=compile,
                          activation_checkpointing=spec)
        torch.manual_seed(0)
        model = Transformer(CFGS[arch])
        step_model = prepare_model(model, cfg.policy, cfg, info, torch.device("cpu"), None)
        with step_context(model), torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            loss = step_model(x, y)[1]
            loss.backward()
        loss = loss.detach().float()
        dist.all_reduce(loss)
        results[(spec, compile, bf16)] = {"loss": loss / world, "grads": _grads(model)}
    return results if rank == 0 else None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, tp, arch, cases", [
    (2, 2, "llama", (("block", True, False), ("block", False, True))),
    (2, 2, "gpt2", (("block", True, False),)),
    (4, 2, "llama", (("block", True, False),)),  # FSDP over the split, compiled
])
def test_tensor_parallel_compiled_and_in_bf16_equals_one_process(world, tp, arch, cases, ranks):
    """--compile under the split (once refused: "fails inside PyTorch 2.13"), each block compiled as torchtitan
    does: the loss and every gradient within fp32 rounding of one process's, at 1 x 2 and under FSDP 2 x 2. In bf16:
    each gradient no further from one process's in bf16 than twice bf16's own distance from fp32 (the split adds
    its partial sums in bf16: 0.3-0.8% here, as bf16 itself)."""
    results = ranks(world).run(_compiled_and_in_bf16, tp, arch, cases, timeout=540)[0]
    for (spec, compiled, bf16), got in results.items():
        loss, grads = _one_process(arch, spec, bf16)
        if not bf16:  # compiled kernels sum in another order: the bounds of FSDP's compiled step (test_distributed.py)
            torch.testing.assert_close(got["loss"], loss, rtol=1e-5 if compiled else 1e-6, atol=0)
            for name, g in grads.items():
                torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"{spec} {name}")
            continue
        torch.testing.assert_close(got["loss"], loss, rtol=1e-3, atol=0)  # bf16's unit: 3.9e-3
        fp32 = _one_process(arch, spec, False)[1]
        for name, g in grads.items():
            assert (got["grads"][name] - g).norm() <= 2 * (g - fp32[name]).norm(), name


PLANNED = ("none", "block", "selective", "block+chunked-loss", "selective+fused-loss")


def _measured_peaks(rank: int, world: int, tp: int, arch: str, specs: tuple[str, ...] = PLANNED) -> dict:
    """Each rank's measured peak of a steady step (`steady_peak`: the trainer's train_step, AdamW's state made by a
    first step), on the trainer's mesh: world / tp data-parallel ranks (FSDP's, where more than one) x tp."""
    from measured import steady_peak

    from fitgpt.config import OptimConfig
    from fitgpt.optim import build_optimizer
    from fitgpt.parallel.fsdp import fsdp_shard
    from fitgpt.parallel.tensor import training_mesh

    mesh = training_mesh("cpu", world, tp)
    peaks = {}
    for spec in specs:
        torch.manual_seed(0)
        model = Transformer(CFGS[arch])
        apply_tensor_parallel(model, mesh["tp"])
        apply_activation_checkpointing(model, spec)
        if world > tp:
            fsdp_shard(model, None, mesh=mesh["dp"])
        opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
        with step_context(model):
            peaks[spec] = steady_peak(model, opt, _batch())
    return peaks


@pytest.mark.slow
@pytest.mark.parametrize("world, tp, arch", [(2, 2, "llama"), (4, 2, "llama"), (2, 2, "gpt2")])
def test_each_tensor_parallel_rank_is_planned_to_the_byte(world, tp, arch, ranks, exact_allocator):
    """`plan --tensor-parallel 2`'s profile (1 x 2; and 2 x 2, FSDP over the data-parallel pair): one rank's step on
    fake ranks, split and sharded as the trainer does it, against each gloo rank's measured peak, for none, block,
    selective and the two loss heads; and the allocator replay's step (exact counts), which is the measured one plus its
    two token batches."""
    from fitgpt.config import OptimConfig
    from fitgpt.estimate.hardware import Target
    from fitgpt.estimate.profile import profile_model
    from fitgpt.estimate.replay import simulate_step
    from fitgpt.plan import Plan, predict

    # FSDP over the pairs (2 x 2): three of the five, each kind of block and loss head once (1 x 2 measures all five)
    specs = PLANNED if world == tp else ("none", "selective", "block+chunked-loss")
    measuring = ranks(world).submit(_measured_peaks, tp, arch, specs)  # the ranks measure while this process predicts
    cfg = CFGS[arch]
    profile = profile_model(cfg, 2, cfg.context_length, "cpu", OptimConfig(), fake=True, tp_ranks=tp,
                            fsdp_ranks=world // tp)
    whole = profile_model(cfg, 2, cfg.context_length, "cpu", OptimConfig(), fake=True)
    peaks = measuring.result()
    for rank, measured in enumerate(peaks):
        for spec, peak in measured.items():
            plan = Plan.from_policy(spec, cfg.n_blocks)[0]
            predicted = predict(profile, plan).peak
            assert predicted == peak, (rank, spec, predicted, peak)
            assert predicted < predict(whole, plan).peak
    for spec, peak in measured.items():
        replay = simulate_step(cfg, spec, 2, cfg.context_length, 1, None, OptimConfig(), Target("cpu"),
                               allocator=exact_allocator(), ranks=world, parallel="fsdp", tp=tp)
        assert replay["max_allocated"] == peak + 2 * 2 * cfg.context_length * 8, spec


@pytest.mark.parametrize("change, words", [
    ({"n_head": 6, "n_kv_head": 3, "n_embed": 48}, "model's n_kv_head (3)"),
    ({"vocab_size": 129}, "model's vocab_size (129)"),
])
def test_what_cannot_be_split_is_refused_in_one_line(change, words):
    why = tensor_parallel_refusal(dataclasses.replace(CFG, **change), 2)
    assert why is not None and words in why and "\n" not in why
    assert tensor_parallel_refusal(CFG, 4) is None and tensor_parallel_refusal(CFG, 8) is not None  # 4 kv heads


@pytest.mark.slow
def test_plan_takes_the_tensor_parallel_degree_and_prints_the_torchrun_command(capsys):
    """One rank of two, profiled on fake ranks: the weights, gradients and moments are half the whole model's, and the
    command it prints launches the split."""
    import json

    from fitgpt.cli import main

    flags = ["plan", "--preset", "llama-tiny", "--model.tie-embeddings", "False", "--gpu", "rtx-4090",
             "--activation-checkpointing", "block"]
    assert main(flags) == 0
    whole = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*flags, "--tensor-parallel", "2"]) == 0
    out = capsys.readouterr().out
    split = json.loads(out.strip().splitlines()[-1])
    assert "torchrun --nproc-per-node 2 -m fitgpt train" in out and "--tensor-parallel 2" in out
    assert "(or: --activation-checkpointing auto --memory-budget" in out  # the trainer plans one rank of the split
    for part in ("params", "optimizer"):
        assert abs(split["breakdown"][part] - whole["breakdown"][part] / 2) <= 512 * 64, part  # the norms stay whole
    assert split["predicted_peak"] < whole["predicted_peak"]
    # 2 x 2: FSDP shards each split again over the data-parallel pair (in bf16 on the card, FSDP's pure half precision).
    assert main([*flags, "--tensor-parallel", "2", "--world-size", "4", "--parallel", "fsdp", "--precision", "fp32"]) == 0
    out = capsys.readouterr().out
    two = json.loads(out.strip().splitlines()[-1])
    assert "torchrun --nproc-per-node 4 -m fitgpt train" in out and "--parallel fsdp --tensor-parallel 2" in out
    assert "per rank of 4 under FSDP 2 x TP 2" in out
    assert two["replay"]["max_reserved"] >= two["replay"]["max_allocated"] > two["predicted_peak"]  # through the allocator
    step_s = two["step_seconds"]  # two data-parallel groups' batches a step, each split over its pair
    assert f"{2 * 16 * 128 / step_s:,.0f} tokens/s predicted" in out
    for part in ("params", "optimizer"):
        assert abs(two["breakdown"][part] - whole["breakdown"][part] / 4) <= 512 * 64, part


@pytest.mark.parametrize("extra, words", [
    (["--tensor-parallel", "2", "--world-size", "4"], "add --parallel fsdp"),
    (["--tensor-parallel", "2", "--world-size", "3"], "use a multiple of 2"),
    (["--tensor-parallel", "2", "--parallel", "fsdp"], "shards nothing"),
    (["--tensor-parallel", "2", "--optim.offload"], "drop --optim.offload"),
    (["--tensor-parallel", "2", "--activation-checkpointing", "offload"], "drop offload"),
])
def test_plan_refuses_what_it_cannot_split_in_one_line(extra, words, capsys):
    from fitgpt.cli import main

    args = ["plan", "--preset", "llama-tiny", "--model.tie-embeddings", "False", "--gpu", "rtx-4090"]
    assert main([*args, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("preset, world, parallel, words", [
    ("llama-tiny", 3, "ddp", "use a multiple of 2"),
    ("llama-tiny", 4, "ddp", "add --parallel fsdp"),
    ("llama-tiny", 2, "fsdp", "shards nothing"),
    ("llama-tiny", 4, "fsdp", None),
    ("llama-tiny", 2, "ddp", None),
    ("tiny", 2, "ddp", None),  # GPT-2 split alone
    ("tiny", 4, "fsdp", None),  # and with FSDP over the split (once refused: "without --parallel fsdp")
])
def test_the_mesh_a_launch_makes_is_checked_before_anything_runs(preset, world, parallel, words):
    """N x tp processes: FSDP over the N data-parallel groups, tp alone without it; anything else in one line."""
    from fitgpt.config import load_config

    cfg = load_config(preset, overrides={"tensor_parallel": 2, "parallel": parallel, "model": {"tie_embeddings": False}})
    why = launch_refusal(cfg, world)
    assert (why is None) if words is None else (words in why and "\n" not in why), why
    if why is None:  # --compile too (once refused on every mesh: "fails inside PyTorch 2.13")
        assert launch_refusal(dataclasses.replace(cfg, compile=True), world) is None


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_tensor_parallel_rank_is_counted_its_share_of_the_flops():
    """Every matmul and attention of a split step runs on 1 / tp of the heads or hidden units, so a rank does exactly
    1 / tp of the step's FLOPs; DTensor's own shape propagation (each new op run once on the whole shapes) is no
    work, and counted, it gave each rank of 2 the FLOPs of 0.98 of the model."""
    from fitgpt.config import OptimConfig
    from fitgpt.estimate.profile import profile_model

    whole, split = (profile_model(CFG, 2, CFG.context_length, "cpu", OptimConfig(), fake=True, tp_ranks=tp)
                    for tp in (1, 2))
    assert split.block_flops == [f // 2 for f in whole.block_flops] and split.step_flops == whole.step_flops // 2


def test_the_ranks_of_a_group_draw_their_own_dropout_masks_on_the_cpu():
    """Seeded alike for the initial weights, the two ranks of a group drew the same mask for each sequence shard;
    seeded apart, each draws its own (the same one on a restart: a seed, not the clock)."""
    from fitgpt.parallel.tensor import seed_dropout_apart

    def mask(tp_rank):
        seed_dropout_apart(torch.device("cpu"), 1337, tp_rank)
        return torch.nn.functional.dropout(torch.ones(4, 64), 0.5) == 0

    assert not torch.equal(mask(0), mask(1)) and torch.equal(mask(1), mask(1))


@pytest.mark.slow
def test_fit_searches_the_tensor_parallel_degree_and_prints_a_command_the_trainer_takes(capsys):
    """4 ranks in a budget that the split's activations fit and FSDP's whole ones do not: fit chooses FSDP x TP 2, and
    the torchrun command it prints names it (launch_refusal passes the chosen config)."""
    from fitgpt.cli import main
    from fitgpt.config import load_config

    assert main(["fit", "--preset", "llama-tiny", "--model.tie-embeddings", "False", "--world-size", "4", "--gpu",
                 "h100-80gb", "--memory-budget", "76MiB", "--precision", "fp32", "--batch-size", "2",
                 "--grad-accum", "1"]) == 0
    out = capsys.readouterr().out
    best = json.loads(out.strip().splitlines()[-1])["fastest"][0]
    assert best["parallel"] == "fsdp x tp2" and best["tensor_parallel"] == 2
    command = next(line for line in out.splitlines() if line.startswith("train the fastest: torchrun --nproc-per-node 4"))
    assert "--parallel fsdp --tensor-parallel 2" in command and "1/t of them" in out
    cfg = load_config("llama-tiny", overrides={"model": {"tie_embeddings": False}, "parallel": "fsdp",
                                               "tensor_parallel": 2, "activation_checkpointing": best["policy"]})
    assert launch_refusal(cfg, 4) is None
