"""Each rank's peak under DDP and FSDP, profiled on fake ranks as the trainer wraps and shards (not one process's
divided) and measured on gloo ranks, to the byte: every option, mixed plans, bf16, Llama's GQA, accumulation, and
FSDP keeping its gathered weights to the backward (--fsdp-reshard-after-forward never). (Losses and gradients against
one process: test_distributed.py.)"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.profile import profile_model
from fitgpt.estimate.replay import simulate_step
from fitgpt.memory.timeline import measure_train_step
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.parallel.data import sync_context
from fitgpt.plan import Plan, predict
from fitgpt.train import distributed as du

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available in this build")
OPTIM = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_steps=0)
CPU = torch.device("cpu")


MIXED = Plan(("block", "none", "selective", "pointwise"))
NONE, CHUNKED = Plan.uniform(4, "none"), Plan.uniform(4, "block", "chunked")
# (parallel, autocast and FSDP param dtype, model, plans): every option, a mixed plan (what auto picks), Llama with GQA;
# accumulation over 2 micro-batches, as the trainer syncs them (DDP adds into its buckets, FSDP reduce-scatters each).
MEMORY_CASES = [("ddp", None, "gpt2", [NONE, CHUNKED, MIXED]),
                ("ddp-accum", None, "gpt2", [NONE, MIXED]),
                ("fsdp-accum", torch.bfloat16, "llama", [NONE, MIXED]),
                ("fsdp", None, "gpt2", [NONE, CHUNKED, Plan.uniform(4, "selective"), Plan.uniform(4, "pointwise"), MIXED]),
                ("fsdp", torch.bfloat16, "gpt2", [NONE, Plan.uniform(4, "block"), MIXED]),
                ("fsdp", torch.bfloat16, "llama", [NONE, Plan.uniform(4, "selective"), MIXED])]


def _memory_model(tiny_model_config, arch: str):
    extra = {"arch": "llama", "n_head": 4, "n_kv_head": 2} if arch == "llama" else {}
    return tiny_model_config(context_length=64, n_embed=64, vocab_size=512, **extra)


def _measured_peaks(rank: int, world: int, cfgs: dict) -> list:
    """Each rank's measured peak (the tracker, at the second step) for every case."""
    from fitgpt.device import autocast
    from fitgpt.parallel.fsdp import precision_roles

    info = du.init_distributed("cpu", timeout_s=120)  # the pool's group, already joined
    B, T = 4, 64
    rows = []
    for mode, dtype, arch, specs in MEMORY_CASES:
        cfg, parallel, accum = cfgs[arch], mode.split("-")[0], 2 if mode.endswith("accum") else 1
        x = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(rank))
        for plan in specs:
            torch.manual_seed(0)
            model = Transformer(cfg)
            apply_activation_checkpointing(model, plan.spec())
            step_model = du.wrap(model, info, parallel, CPU, precision_roles(dtype, parallel == "fsdp")[1])
            opt = build_optimizer(model, OPTIM, CPU)
            kw = {"amp": autocast(CPU, precision_roles(dtype, parallel == "fsdp")[0]),  # as the trainer
                  "sync": lambda last, m=step_model: sync_context(m, last)}
            measure_train_step(step_model, opt, [(x, x)] * accum, **kw)  # the optimizer state exists from here on
            rows.append((mode, str(dtype), arch, plan.spec(), measure_train_step(step_model, opt, [(x, x)] * accum, **kw).peak))
    return rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plan_predicts_each_ranks_peak_under_ddp_and_fsdp(ranks, tiny_model_config, exact_allocator):
    """Profiled, not divided: FSDP's step is profiled as one rank of two on fake ranks, sharded as the trainer shards;
    every rank's measured peak equals the prediction to the byte, for every option, mixed plans, bf16 and Llama GQA,
    with accumulation as the trainer syncs it. The allocator replay (DDP wrapped and FSDP sharded as the trainer does,
    on fake ranks) replays each step's very allocations: on exact counts, its peak is the measured one plus the
    token batches."""
    cfgs = {arch: _memory_model(tiny_model_config, arch) for arch in ("gpt2", "llama")}
    measuring = ranks(2).submit(_measured_peaks, cfgs)  # the ranks measure while this process predicts
    rows = []
    for mode, dtype, arch, specs in MEMORY_CASES:
        cfg, accum = cfgs[arch], 2 if mode.endswith("accum") else 1
        kw = {"persistent_grads": True} if mode.startswith("ddp") else {"fsdp_ranks": 2}
        profile = profile_model(cfg, 4, 64, "cpu", dtype=dtype, fake=True, grad_accum=accum, **kw)
        for plan in specs:
            rows.append((mode, str(dtype), arch, plan.spec(), predict(profile, plan).peak))
    measured = measuring.result()
    for r in range(2):
        assert [row[:4] for row in measured[r]] == [row[:4] for row in rows]
        assert [row[4] for row in measured[r]] == [row[4] for row in rows]
    peaks = {row[:4]: row[4] for row in measured[0]}
    for mode, dtype, arch, plan in [("ddp", None, "gpt2", MIXED), ("ddp-accum", None, "gpt2", MIXED),
                                    ("fsdp-accum", torch.bfloat16, "llama", MIXED)]:
        accum = 2 if mode.endswith("accum") else 1
        replay = simulate_step(cfgs[arch], plan.spec(), 4, 64, accum, dtype, dataclasses.replace(OPTIM, grad_clip=0.0),
                               Target("cpu"), allocator=exact_allocator(), ranks=2, parallel=mode.split("-")[0])
        assert replay["max_allocated"] == peaks[mode, str(dtype), arch, plan.spec()] + accum * 2 * 4 * 64 * 8, mode
    ddp = {spec: m for par, dt, arch, spec, m in measured[0] if par == "ddp"}
    fsdp = {spec: m for par, dt, arch, spec, m in measured[0] if par == "fsdp" and dt == "None" and arch == "gpt2"}
    assert all(fsdp[k] < ddp[k] for k in ddp)  # sharded weights, gradients and optimizer state


# FSDP keeping each block's gathered weights from its forward to its backward (--fsdp-reshard-after-forward never,
# torchtitan's setting under pipeline parallelism; issue 69).
KEPT_CASES = [(None, "gpt2", [NONE, Plan.uniform(4, "block")]), (torch.bfloat16, "llama", [NONE, MIXED])]


def _measured_kept(rank: int, world: int, cfgs: dict) -> list:
    """Each rank's measured peak (the tracker, at the second step) for every case of KEPT_CASES."""
    from fitgpt.device import autocast
    from fitgpt.parallel.fsdp import precision_roles

    info = du.init_distributed("cpu", timeout_s=120)  # the pool's group, already joined
    x = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(rank))
    rows = []
    for dtype, arch, specs in KEPT_CASES:
        for plan in specs:
            torch.manual_seed(0)
            model = Transformer(cfgs[arch])
            apply_activation_checkpointing(model, plan.spec())
            amp_dtype, param_dtype = precision_roles(dtype, True)
            step_model = du.wrap(model, info, "fsdp", CPU, param_dtype, reshard_after_forward=False)
            opt = build_optimizer(model, OPTIM, CPU)
            measure_train_step(step_model, opt, [(x, x)], amp=autocast(CPU, amp_dtype))
            rows.append(measure_train_step(step_model, opt, [(x, x)], amp=autocast(CPU, amp_dtype)).peak)
    return rows


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_keeping_gathered_weights_to_the_backward_is_planned_to_the_byte(ranks, tiny_model_config, exact_allocator):
    """With each block's weights kept gathered from its forward to its backward, every rank's measured peak equals
    the profile's prediction and the allocator replay's, to the byte; and it is not resharding's."""
    cfgs = {arch: _memory_model(tiny_model_config, arch) for arch in ("gpt2", "llama")}
    measuring = ranks(2).submit(_measured_kept, cfgs)
    kept, resharded = [], []
    for dtype, arch, specs in KEPT_CASES:
        for flag, out in ((False, kept), (True, resharded)):
            profile = profile_model(cfgs[arch], 4, 64, "cpu", dtype=dtype, fake=True, fsdp_ranks=2,
                                    reshard_after_forward=flag)
            out += [predict(profile, plan).peak for plan in specs]
    replay = simulate_step(cfgs["gpt2"], NONE.spec(), 4, 64, 1, None, dataclasses.replace(OPTIM, grad_clip=0.0),
                           Target("cpu"), allocator=exact_allocator(), ranks=2, reshard_after_forward=False)
    measured = measuring.result()
    assert measured[0] == measured[1] == kept
    assert replay["max_allocated"] == kept[0] + 2 * 4 * 64 * 8  # the token batches besides
    assert all(k != r for k, r in zip(kept, resharded))
