"""A deep step's allocations and frees from a shallow step's: exact, or not at all."""

import pytest
import torch

from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.config import OptimConfig
from fitgpt.estimate.deepen import NotAlike, Recording, deepen
from fitgpt.estimate.hardware import Target, find_gpu
from fitgpt.estimate.replay import simulate_step
from fitgpt.estimate.source import HFModel


def _both(logging, cfg, policy, accum, optim, ranks, dtype=torch.bfloat16):
    """The step replayed at full depth and deepened: (peaks, the allocator's log) of each."""
    target = Target("cuda", find_gpu("h100-80gb"))
    out = {}
    for deep in (False, True):
        log = logging()
        peaks = simulate_step(cfg, policy, 2, 32, accum, dtype, optim, target, allocator=log, ranks=ranks, parallel="fsdp",
                              deep=deep)
        out[deep] = peaks, log
    return out


@pytest.mark.parametrize("arch, n_blocks, ranks, policy, accum, optim", [
    pytest.param("llama", 10, 1, "block", 2, OptimConfig(), marks=pytest.mark.slow),
    ("gpt2", 10, 1, "selective+chunked-loss:32", 1, OptimConfig(impl="foreach", grad_clip=1.0)),
    pytest.param("llama", 12, 2, "blocks:0,1,2,3+selective:4,5,6,7,8,9,10,11", 2, OptimConfig(), marks=pytest.mark.slow),
    pytest.param("llama", 12, 4, "torchtitan:0,1,2,3,4,5,6,7+fused-loss", 1, OptimConfig(impl="foreach"), marks=pytest.mark.slow),
])
def test_the_deepened_step_is_the_full_depth_step(arch, n_blocks, ranks, policy, accum, optim, tiny_model_config,
                                                  logging_allocator):
    """Recorded shallow (one run of blocks alike, or two; FSDP's gathers let go two blocks on; accumulation, clipping,
    fused and foreach AdamW) and deepened: the full-depth step's allocations and frees, one by one, and its peaks."""
    kw = {"n_kv_head": 2} if arch == "llama" else {}
    runs = _both(logging_allocator, tiny_model_config(arch=arch, n_blocks=n_blocks, **kw), policy, accum, optim, ranks)
    (full, full_log), (deep, deep_log) = runs[False], runs[True]
    assert "b" in deep_log.kinds and "b" not in full_log.kinds
    n = len(deep_log.log)
    assert deep_log.log == full_log.log[:n]
    assert all(e < 0 for e in full_log.log[n:])  # the full step's model and optimizer let go after it, not replayed
    assert deep == full


@pytest.mark.slow  # 2.5 s or more here: the quick loop leaves it to the full suite
def test_a_hugging_face_model_deepened_is_its_full_depth_step(logging_allocator):
    """A Hugging Face model's decoder layers repeat alike too (its mask and position ids made before the first)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=10, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    runs = _both(logging_allocator, HFModel(config), "selective", 1, OptimConfig(), 1)
    (full, full_log), (deep, deep_log) = runs[False], runs[True]
    n = len(deep_log.log)
    assert "b" in deep_log.kinds and deep_log.log == full_log.log[:n] and deep == full


def test_a_plan_of_groups_of_blocks_is_stepped_at_full_depth(tiny_model_config, logging_allocator):
    """A group runs its blocks as one region: no block repeats alone, so the step is not deepened."""
    runs = _both(logging_allocator, tiny_model_config(n_blocks=10), "group:2", 1, OptimConfig(), 1)
    assert "b" not in runs[True][1].kinds and runs[True][0] == runs[False][0]


def _recording(n_blocks, segments) -> Recording:
    """A Recording of ``segments``: (mark, [("m", name, bytes) | ("f", name)]), names standing for keys."""
    rec = Recording(n_blocks)
    for mark, events in segments:
        if mark:
            rec.mark(mark)
        for e in events:
            rec.malloc(e[1], e[2]) if e[0] == "m" else rec.free(e[1])
    return rec


def _b(block, place):
    return ("b", "fwd", 1, block, place)


def test_a_middle_block_repeats_with_what_it_frees_renamed():
    """Block 2 of 4 run three times: each copy makes a temporary and an output and lets go of the previous block's
    output (the previous copy's); the blocks after it are renumbered; the update's result maps to the full-depth one."""
    rec = _recording(4, [
        ("", [("m", "x", 8)]),
        ("fwd_pre_0", [("m", "t0", 4), ("f", "t0"), ("m", "o0", 16)]),
        ("fwd_post_0", [("m", "t1", 4), ("f", "t1"), ("m", "o1", 16), ("f", "o0")]),
        ("fwd_post_1", [("m", "t2", 4), ("f", "t2"), ("m", "o2", 16), ("f", "o1")]),
        ("fwd_post_2", [("m", "o3", 16), ("f", "o2")]),
        ("fwd_post_3", [("f", "o3")]),
        ("update", [("m", "n", 4)]),
        ("update_end", [("f", "n"), ("f", "x")]),
    ])
    events = deepen(rec, [1, 1, 3, 1], [(("u", 0), 4)], [(8, ("u", 0))])
    expected = [(("g", 0), 8), (_b(0, 0), 4), (_b(0, 0), None), (_b(0, 1), 16)]
    for i in range(1, 5):  # block 1, then block 2 as full-depth blocks 2, 3 and 4
        expected += [(_b(i, 0), 4), (_b(i, 0), None), (_b(i, 1), 16), (_b(i - 1, 1), None)]
    expected += [(_b(5, 0), 16), (_b(4, 1), None), (_b(5, 0), None), (("u", 0), 4), (("u", 0), None), (("g", 0), None)]
    assert events == expected


def test_a_middle_block_that_frees_from_an_unlike_neighbour_is_not_deepened():
    """Block 2 frees what block 0 made; its copy at full-depth block 3 would free from block 1, which block 1 does not
    make as block 0 did: NotAlike, and the caller steps the full depth."""
    rec = _recording(4, [
        ("fwd_pre_0", [("m", "a", 16), ("m", "b", 8)]),
        ("fwd_post_0", [("m", "c", 16)]),
        ("fwd_post_1", [("f", "a"), ("m", "d", 16)]),
        ("fwd_post_2", []),
    ])
    with pytest.raises(NotAlike, match="unlike"):
        deepen(rec, [1, 1, 3, 1], [], [])


def test_a_policy_of_some_blocks():
    p = parse_policy("blocks:0,1+selective:2,3+offload:3+chunked-loss:512")
    assert p.of_blocks([0, 2, 3], 4) == "blocks:0+selective:1,2+offload:2+chunked-loss:512"
    assert parse_policy("none").of_blocks([0, 1], 5) == "none"
    assert parse_policy("group:2").of_blocks([0, 1], 4) is None
