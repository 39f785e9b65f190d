"""Every optimizer over pipeline stages (issue 69): Muon, Adafactor, 8-bit AdamW and pure bf16 weights over 2 stages
sharded by FSDP, and Muon over 2 stages split by tensor parallelism, on 4 gloo ranks, built as the trainer builds them
(`fitgpt.train.setup.prepare_model`), against one process at the same global batch. Through the trainer and its
checkpoints (APOLLO's projections and groups numbered as one process numbers them): test_pipeline_runs.py."""

import pytest
import torch
import torch.distributed as dist

STEPS = 8
BASE = {"model": {"vocab_size": 256, "context_length": 32, "dropout": 0.0}, "batch_size": 8,
        "optim": {"lr": 1e-3, "warmup_steps": 0}, "activation_checkpointing": "none"}
SETTINGS = {"adamw": {"optim": {}}, "muon": {"optim": {"name": "muon"}}, "adafactor": {"optim": {"name": "adafactor"}},
            "adamw8bit": {"optim": {"name": "adamw8bit"}},
            "bf16-adamw": {"model": {"weights_dtype": "bf16"}, "optim": {}}}
# One process's losses to fp32's rounding of the gradients' reduction, 8 steps on (measured: Adafactor 2.6e-7, 8-bit
# AdamW 6.9e-7, Muon 2.4e-6); bf16 weights' gradients reduced across the stage's ranks in bf16 (8.0e-5). Issue 69
# asked for 0.5%.
RTOL = {"bf16-adamw": 2e-4}


def _config(name: str, layout: dict | None = None):
    from fitgpt.config import load_config

    setting = SETTINGS[name]
    layout = layout or {}
    overrides = {**BASE, **layout, "model": {**BASE["model"], **layout.get("model", {}), **setting.get("model", {})},
                 "optim": {**BASE["optim"], **setting["optim"]}}
    return load_config("llama-tiny", overrides=overrides)


def _batch(cfg, step: int, rows: int = 8):
    """Step ``step``'s global batch (rows, T), one process's."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, cfg.model.vocab_size, (rows, cfg.model.context_length + 1), generator=g)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def one_process(name: str, model_settings: dict | None = None) -> list[float]:
    """``name``'s losses in one process (``model_settings``: the layout's own, as its "model" entry)."""
    from fitgpt.optim import build_optimizer
    from fitgpt.step import train_step
    from fitgpt.train.setup import build_model

    cfg = _config(name, {"model": model_settings or {}})
    model = build_model(cfg, cfg.model.vocab_size, torch.device("cpu"))
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"), seed=cfg.seed)
    return [train_step(model, optimizer, [_batch(cfg, step)], grad_clip=cfg.optim.grad_clip).loss.item()
            for step in range(STEPS)]


def pipelined(rank: int, world: int, names: list[str], layout: dict) -> dict:
    """Each optimizer of ``names`` over 2 stages of ``layout``: its losses (the global batch's mean), each rank its
    data-parallel rank's rows of the batch, the pipeline built as the trainer builds it."""
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.optim import build_optimizer
    from fitgpt.parallel.stages import materialise
    from fitgpt.parallel.tensor import step_context
    from fitgpt.step import train_step
    from fitgpt.train.distributed import DistInfo, data_rank, data_ranks
    from fitgpt.train.setup import build_model, prepare_model

    out = {}
    for name in names:
        cfg = _config(name, layout)
        info = DistInfo(rank, world, rank)
        model = build_model(cfg, cfg.model.vocab_size, torch.device("cpu"), world)
        pipe = prepare_model(model, parse_policy(cfg.activation_checkpointing), cfg, info, torch.device("cpu"), None)
        materialise(model, pipe.stages, torch.device("cpu"), cfg.seed)
        optimizer = build_optimizer(pipe.held, cfg.optim, torch.device("cpu"), seed=cfg.seed)
        n, i = data_ranks(cfg, info), data_rank(cfg, info)
        losses = []
        with step_context(pipe.held):
            for step in range(STEPS):
                x, y = _batch(cfg, step, cfg.batch_size * n)
                loss = train_step(pipe, optimizer, [(x[i::n], y[i::n])], grad_clip=cfg.optim.grad_clip).loss.clone()
                dist.all_reduce(loss)  # each data-parallel rank's mean, on each of its world / n ranks
                losses.append(loss.item() / world)
        out[name] = losses
    return out


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout, names", [
    ({"pipeline_parallel": 2, "parallel": "fsdp", "batch_size": 4}, ["muon", "adafactor", "adamw8bit", "bf16-adamw"]),
    ({"pipeline_parallel": 2, "tensor_parallel": 2}, ["muon"]),
    # A zero-bubble schedule over FSDP, each block's weights kept gathered to its backward (as it must be there).
    ({"pipeline_parallel": 2, "parallel": "fsdp", "batch_size": 4, "pipeline_schedule": "zbv",
      "fsdp_reshard_after_forward": "torchtitan", "model": {"tie_embeddings": False}}, ["adamw"]),
])
def test_every_optimizer_over_stages_trains_as_one_process(layout, names, ranks):
    """Each loss of 8 steps within 1e-5 of one process's (2e-4 over bf16 weights): Muon's matrices stepped whole by
    their owners, 8-bit AdamW's blocks quantized whole, bf16 weights rounded by each parameter's place in the whole
    model, as one process does."""
    got = ranks(4).run(pipelined, names, layout)
    for name in names:
        expected = one_process(name, layout.get("model"))
        for rank in got:
            torch.testing.assert_close(torch.tensor(rank[name]), torch.tensor(expected), rtol=RTOL.get(name, 1e-5), atol=0,
                                       msg=f"{name}: {rank[name]} against {expected}")
