"""The caching-allocator model and the replay of a plan's step through it."""

import pytest
import torch

from fitgpt.config import OptimConfig
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.replay import simulate_step
from fitgpt.memory.allocator import CachingAllocatorModel

MiB = 2**20


def test_small_pool_rounds_splits_and_reuses():
    a = CachingAllocatorModel()
    a.malloc(1, 100)  # rounded to 512, from a new 2 MiB small segment
    a.malloc(2, 1000)  # 1024, split from the same segment
    assert (a.allocated, a.reserved) == (1536, 2 * MiB)
    a.free(1)
    a.malloc(3, 512)  # best fit: the 512-byte hole, no new segment
    assert (a.allocated, a.reserved, a.peak_allocated) == (1536, 2 * MiB, 1536)


def test_large_pool_hands_out_unsplit_blocks_whole_and_merges_on_free():
    a = CachingAllocatorModel()
    a.malloc(1, 3 * MiB)  # a 20 MiB segment, split: 17 MiB stay free
    a.malloc(2, 16 * MiB + MiB // 2)  # 0.5 MiB would remain: not split, all 17 MiB are handed out
    assert (a.allocated, a.reserved) == (20 * MiB, 20 * MiB)
    a.malloc(3, 11 * MiB + 1)  # over 10 MiB: its own 12 MiB segment; under 1 MiB would remain, so all of it
    assert (a.allocated, a.reserved) == (32 * MiB, 32 * MiB)
    a.free(1)
    a.free(2)  # merges with the freed 3 MiB before it: one 20 MiB free block
    a.malloc(4, 19 * MiB)  # fits the merged block (1 MiB left is not over 1 MiB: handed out whole)
    assert (a.allocated, a.reserved) == (32 * MiB, 32 * MiB)
    assert a.peak_allocated == a.allocated and a.peak_reserved == 32 * MiB


@pytest.mark.parametrize("policy, optim", [("none", OptimConfig()), ("block", OptimConfig()),
                                           ("selective+chunked-loss", OptimConfig()),
                                           ("block", OptimConfig(in_backward=True))])
def test_the_replayed_step_is_the_real_step(policy, optim, tiny_model_config, exact_allocator):
    """On exact counts the replay equals a real bf16 step measured on this CPU, plus its token batches (in the
    backward, clipping: the first pass that takes the norms too, where the replay once stopped on a fake value)."""
    from fitgpt.activation_checkpoint import apply_activation_checkpointing
    from fitgpt.device import autocast
    from fitgpt.memory.timeline import measure_train_step
    from fitgpt.model import Transformer
    from fitgpt.optim import build_optimizer

    cfg, B, T = tiny_model_config(), 4, 32
    replay = simulate_step(cfg, policy, B, T, 1, torch.bfloat16, optim, Target("cpu"), allocator=exact_allocator())
    model = Transformer(cfg)
    opt = build_optimizer(model, optim, torch.device("cpu"))
    apply_activation_checkpointing(model, policy)
    x = torch.zeros(B, T, dtype=torch.long)
    kw = {"amp": autocast(torch.device("cpu"), torch.bfloat16), "grad_clip": 1.0}
    measure_train_step(model, opt, [(x, x)], **kw)
    real = measure_train_step(model, opt, [(x, x)], **kw).peak
    assert replay["max_allocated"] == real + 2 * B * T * 8


def test_replay_for_a_card_counts_blocks_segments_and_workspaces(tiny_model_config, exact_allocator):
    target = Target("cuda", find_gpu("a100-80gb"))
    r = simulate_step(tiny_model_config(), "block", 4, 32, 2, torch.bfloat16, OptimConfig(), target)
    exact = simulate_step(tiny_model_config(), "block", 4, 32, 2, torch.bfloat16, OptimConfig(), target, allocator=exact_allocator())
    assert r["max_allocated"] >= exact["max_allocated"]  # blocks are whole multiples of 512 bytes
    assert r["max_reserved"] >= r["max_allocated"] and r["max_reserved"] % (2 * MiB) == 0
    assert exact["max_allocated"] > target.workspace_bytes()  # the workspaces are in


@pytest.mark.parametrize("policy, accum, ranks, parallel, optim", [
    ("none", 1, 1, None, OptimConfig()),
    pytest.param("block+chunked-loss", 2, 1, None, OptimConfig(impl="foreach"), marks=pytest.mark.slow),
    pytest.param("selective", 3, 1, None, OptimConfig(name="adamw4bit"), marks=pytest.mark.slow),
    pytest.param("pointwise", 1, 1, None, OptimConfig(in_backward=True), marks=pytest.mark.slow),
    pytest.param("block", 1, 1, None, OptimConfig(name="adamw8bit"), marks=pytest.mark.slow),
    pytest.param("none", 2, 1, None, OptimConfig(state_dtype="bf16"), marks=pytest.mark.slow),
    pytest.param("blocks:0+selective:1", 2, 2, "fsdp", OptimConfig(), marks=pytest.mark.slow),
    pytest.param("torchtitan", 1, 2, "fsdp", OptimConfig(impl="foreach"), marks=pytest.mark.slow),
    ("none", 1, 2, "ddp", OptimConfig()),
])
def test_the_repeated_step_is_the_second_step_run(policy, accum, ranks, parallel, optim, tiny_model_config, logging_allocator):
    """The replay's measured step, repeated from the first step's allocations less the optimizer state, is the second
    step run on fake tensors, allocation by allocation and free by free ."""
    cfg, target = tiny_model_config(arch="llama", n_kv_head=2), Target("cuda", find_gpu("a100-80gb"))
    runs = {}
    for repeat in (False, True):
        log = logging_allocator()
        kw = {"ranks": ranks, "parallel": parallel or "fsdp", "deep": False}
        peaks = simulate_step(cfg, policy, 4, 32, accum, torch.bfloat16, optim, target, allocator=log, repeat=repeat, **kw)
        runs[repeat] = (peaks, log.measured, "again" in log.kinds)
    assert not runs[False][2] and runs[True][2]  # the second is repeated, not run
    assert runs[True][1] == runs[False][1]
    assert runs[True][0] == runs[False][0]


def test_a_step_that_adds_into_kept_gradients_is_run_again(tiny_model_config, logging_allocator):
    """DDP with accumulation keeps its gradients (views of its buckets) zeroed between steps: the second step adds
    into them, where the first made them, so its allocations differ and it is run, not repeated."""
    log = logging_allocator()
    simulate_step(tiny_model_config(), "block", 4, 32, 2, torch.bfloat16, OptimConfig(impl="foreach"),
                  Target("cuda", find_gpu("a100-80gb")), allocator=log, ranks=2, parallel="ddp")
    assert "again" not in log.kinds
