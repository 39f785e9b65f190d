"""A pipeline rank's step put together from a small step of it (`fitgpt.estimate.pipeline_compose`): the composed plan
equals the whole step's, to the byte, allocation by allocation, over schedules, policies and layouts; the pieces of the
composition on exact token lists."""

from __future__ import annotations

import pytest

from fitgpt.estimate.pipeline_compose import action_order, expand, let_go_together
from fitgpt.estimate.pipeline_marks import Mark

TINY = {"model": {"vocab_size": 512, "context_length": 64, "n_embed": 64, "n_head": 4, "n_kv_head": 2,
                  "tie_embeddings": False, "n_blocks": 12}, "batch_size": 8, "pipeline_microbatches": 8}


def test_a_middle_block_stands_for_every_block_between_the_first_and_the_last():
    b = lambda j: Mark("b", 0, j)  # noqa: E731
    chunk = [5, b(0), 1, -1, b(0), 2, b(1), 3, -3, b(2), 4, -9, b(1), 7]  # a forward, then FSDP's reductions
    assert expand(chunk, 5, 3) == [5, 1, -1, 2, 3, -3, 3, -3, 3, -3, 4, -9, 7, 7, 7]
    assert expand(chunk, 3, 3) == [5, 1, -1, 2, 3, -3, 4, -9, 7]  # as recorded, marks dropped


def test_what_the_schedule_lets_go_of_at_its_end_grows_with_the_micro_batches():
    # A run of one size's frees, made by the forwards of micro-batches 0..2 and the backwards of 0..1, each kind from
    # the first: 2 more micro-batches free 2 more of each kind. The last two backwards' frees (made by 1 and 2, not
    # from the first) and a lone free are what every step frees.
    chunk = [-4, -4, -4, -4, -4, 9, -8, -8, -6]
    births = [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("F", 1, 2), ("B", 1, 1), None, ("B", 1, 1), ("B", 1, 2),
              ("F", 1, 0)]
    assert let_go_together(chunk, births, 2) == [-4] * 5 + [-4] * 4 + [9, -8, -8, -6]
    assert let_go_together(chunk, births, 0) == chunk


def test_the_predicted_orders_are_pytorchs():
    assert action_order("gpipe", 2, 1, 2) == [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]
    assert action_order("1f1b", 4, 1, 5) == [("F", 1, 0), ("F", 1, 1), ("F", 1, 2), ("B", 1, 0), ("F", 1, 3),
                                             ("B", 1, 1), ("F", 1, 4), ("B", 1, 2), ("B", 1, 3), ("B", 1, 4)]
    order = action_order("interleaved-1f1b", 2, 0, 4)  # rank 0 of 2 holds stages 0 and 2
    assert sorted(order) == sorted((k, s, m) for k in "FB" for s in (0, 2) for m in range(4))
    assert order[:3] == [("F", 0, 0), ("F", 0, 1), ("F", 2, 0)]


def _body(trace: tuple[int, ...]) -> list[int]:
    """A step's levels without the frees it ends with (``zero_grad``'s: a composed plan's tail gives each gradient
    a storage of its own, where FSDP's share one a block; the levels before them, and after, are the same)."""
    out = list(trace)
    while len(out) > 1 and out[-1] < out[-2]:
        out.pop()
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, extra", [
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "activation_checkpointing": "none", "model": {"n_blocks": 8}}),
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "activation_checkpointing": "block"}),
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b", "activation_checkpointing": "block",
         "model": {"n_blocks": 16}}),
    # FSDP's stages under 1F1B and TP's under plain 1F1B are each a schedule composed above and a layout composed
    # below (FSDP under GPipe and interleaved, TP under interleaved, tied): not run again
    (4, {"pipeline_parallel": 2, "tensor_parallel": 2, "pipeline_schedule": "interleaved-1f1b",
         "activation_checkpointing": "selective", "model": {"n_blocks": 16, "tie_embeddings": True}}),
    (4, {"pipeline_parallel": 4, "pipeline_schedule": "1f1b", "activation_checkpointing": "selective",
         "pipeline_microbatches": 12, "batch_size": 12, "model": {"n_blocks": 18}}),
    (4, {"pipeline_parallel": 2, "parallel": "fsdp", "pipeline_schedule": "gpipe", "activation_checkpointing": "none",
         "pipeline_microbatches": 6, "batch_size": 6, "model": {"tie_embeddings": True}}),
    # a rank's two FSDP stages, each gathered ahead by the schedule and let go of by what it ran last; uneven (40
    # blocks over 12 stages); ranks 1-3 composed from the small step of rank 4 (`stand_ins`)
    (12, {"pipeline_parallel": 6, "parallel": "fsdp", "pipeline_schedule": "interleaved-1f1b",
          "activation_checkpointing": "block", "pipeline_microbatches": 12, "batch_size": 12, "model": {"n_blocks": 40}}),
])
def test_a_composed_plan_is_the_whole_steps(world, extra, monkeypatch):
    """Each rank composed from a small step (three blocks a stage, fewer micro-batches) plans what its whole step
    does: the same peak and held bytes, and the same bytes alive after every allocation and free of the step; the
    stages uneven (18 blocks over 4), tied, split by TP, sharded by FSDP; a rank composed from another's small step."""
    from fitgpt.config import load_config
    from fitgpt.estimate import pipeline
    from fitgpt.estimate.pipeline_compose import small_config, stand_ins

    monkeypatch.setattr(pipeline, "TRACE_POINTS", 10**9)  # every point (the forked ranks see it too)
    overrides = {**TINY, **extra, "model": {**TINY["model"], **extra.get("model", {})}}
    cfg = load_config("llama-tiny", overrides=overrides)
    assert all(small_config(cfg, r) is not None for r in range(cfg.pipeline_parallel))
    checked = list(range(cfg.pipeline_parallel))
    if cfg.pipeline_parallel == 6:
        assert stand_ins(cfg, checked) == {0: 0, 1: 4, 2: 4, 3: 4, 4: 4, 5: 5}
        checked = [3, 5]  # one served by rank 4 (its first stage has 4 blocks, rank 4's 3), and the last; run whole
    whole = pipeline.plan_pipeline(cfg, world, ranks=checked, whole=True)
    composed = pipeline.plan_pipeline(cfg, world)
    assert all(c.composed for c in composed) and not any(w.composed for w in whole)
    for w, c in zip(whole, [composed[r] for r in checked]):
        assert (c.peak, c.params, c.grads, c.optimizer, c.buffers, c.blocks) == (
            w.peak, w.params, w.grads, w.optimizer, w.buffers, w.blocks)
        assert _body(c.trace) == _body(w.trace) and c.trace[-1] == w.trace[-1]
