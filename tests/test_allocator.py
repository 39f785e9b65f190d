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


@pytest.mark.parametrize("policy", ["none", "block", "selective+chunked-loss"])
def test_the_replayed_step_is_the_real_step(policy, tiny_model_config, exact_allocator):
    """On exact counts the replay equals a real bf16 step measured on this CPU, plus its token batches."""
    from fitgpt.activation_checkpoint import apply_activation_checkpointing
    from fitgpt.device import autocast
    from fitgpt.memory.timeline import measure_train_step
    from fitgpt.model import Transformer
    from fitgpt.optim import build_optimizer

    cfg, B, T = tiny_model_config(), 4, 32
    replay = simulate_step(cfg, policy, B, T, 1, torch.bfloat16, OptimConfig(), Target("cpu"), allocator=exact_allocator())
    model = Transformer(cfg)
    opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
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
