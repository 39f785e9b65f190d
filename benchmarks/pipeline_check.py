"""Pipeline parallelism on gloo CPU ranks (issue 58): each rank's measured peak (the tracker, at its second step,
the pipeline made by the trainer's `prepare_model`) against its plan (`fitgpt.estimate.pipeline`: the trainer's
schedule run as that rank on fake ranks), per schedule, checkpointing policy and layout; and, with --torchtitan,
torchtitan's Llama 3.1 405B layout planned per rank on an H100 (FSDP 8 x TP 8 x PP 8, full checkpointing, local batch
32 x 8192, one-row micro-batches).

    python benchmarks/pipeline_check.py                # a few minutes on 2 cores
    python benchmarks/pipeline_check.py --torchtitan 1f1b      # (or interleaved-1f1b) the 405B plan, every rank
    python benchmarks/pipeline_check.py --torchtitan 1f1b --ranks 0 --whole   # rank 0 run whole, to compare
    python benchmarks/pipeline_check.py --torchtitan 1f1b --reshard torchtitan   # FSDP's weights kept to the backward
    python benchmarks/pipeline_check.py --torchtitan 1f1b --reshard torchtitan --float8 tensorwise   # and Float8

Prints Markdown tables for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fitgpt.config import load_config, merge
from fitgpt.estimate.pipeline import plan_pipeline

# Llama, 256 wide, 8 blocks, untied; each pipeline's batch 8 x 256.
BASE = {"model": {"vocab_size": 2048, "context_length": 256, "n_embed": 256, "n_head": 8, "n_kv_head": 4, "n_blocks": 8,
                  "tie_embeddings": False}, "batch_size": 8}
CASES = [  # (processes, overrides)
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "gpipe", "activation_checkpointing": "none"}),
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "activation_checkpointing": "none", "pipeline_microbatches": 8}),
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "1f1b", "activation_checkpointing": "selective",
         "pipeline_microbatches": 8}),
    (2, {"pipeline_parallel": 2, "pipeline_schedule": "interleaved-1f1b", "activation_checkpointing": "block",
         "pipeline_microbatches": 4}),
    (4, {"pipeline_parallel": 4, "pipeline_schedule": "1f1b", "activation_checkpointing": "none", "pipeline_microbatches": 8}),
    (4, {"pipeline_parallel": 2, "parallel": "fsdp", "pipeline_schedule": "1f1b", "activation_checkpointing": "none"}),
    (4, {"pipeline_parallel": 2, "tensor_parallel": 2, "pipeline_schedule": "1f1b", "activation_checkpointing": "selective",
         "pipeline_microbatches": 4}),
    (4, {"pipeline_parallel": 2, "parallel": "fsdp", "pipeline_schedule": "interleaved-1f1b", "activation_checkpointing": "block",
         "pipeline_microbatches": 8, "model": {"n_blocks": 16}}),
]


def _config(overrides: dict):
    return load_config("llama-tiny", overrides=merge(BASE, overrides))


def _worker(rank: int, world: int, port: int, out: str, overrides: dict) -> None:
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.memory.timeline import PeakProbe
    from fitgpt.optim import build_optimizer
    from fitgpt.parallel.stages import materialise
    from fitgpt.parallel.tensor import step_context
    from fitgpt.step import train_step
    from fitgpt.train.distributed import DistInfo
    from fitgpt.train.setup import build_model, prepare_model

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    try:
        cfg, cpu = _config(overrides), torch.device("cpu")
        model = build_model(cfg, cfg.model.vocab_size, cpu, world)
        pipe = prepare_model(model, parse_policy(cfg.activation_checkpointing), cfg, DistInfo(rank, world, rank), cpu, None)
        materialise(model, pipe.stages, cpu, cfg.seed)
        optimizer = build_optimizer(pipe.held, cfg.optim, cpu, seed=cfg.seed)
        ids = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.model.context_length),
                            generator=torch.Generator().manual_seed(rank))
        with step_context(pipe.held):
            train_step(pipe, optimizer, [(ids, ids)], grad_clip=cfg.optim.grad_clip)
            with PeakProbe(pipe.held, optimizer, pipe.comm_buffers()) as probe:
                train_step(pipe, optimizer, [(ids, ids)], grad_clip=cfg.optim.grad_clip)
        torch.save(probe.result.peak, os.path.join(out, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def measured(world: int, overrides: dict) -> list[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(world, port, out, overrides), nprocs=world)
        return [torch.load(os.path.join(out, f"{r}.pt")) for r in range(world)]


def _name(world: int, o: dict) -> str:
    dp = world // (o["pipeline_parallel"] * o.get("tensor_parallel", 1))
    layout = f"PP {o['pipeline_parallel']}" + (f" x FSDP {dp}" if dp > 1 else "") + (
        f" x TP {o['tensor_parallel']}" if o.get("tensor_parallel", 1) > 1 else "")
    return f"{layout}, {o['pipeline_schedule']}, {o['activation_checkpointing']}, {o.get('pipeline_microbatches') or '-'} mb"


def check() -> None:
    print("| layout, schedule, policy, micro-batches | rank | planned | measured | difference | planned in | composed |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for world, overrides in CASES:
        t0 = time.perf_counter()
        plans = plan_pipeline(_config(overrides), world)
        seconds = time.perf_counter() - t0
        peaks = measured(world, overrides)
        per_stage = world // overrides["pipeline_parallel"]
        for r, peak in enumerate(peaks):
            plan = plans[r // per_stage]
            print(f"| {_name(world, overrides)} | {r} | {plan.peak:,} | {peak:,} | {peak - plan.peak:+,} | "
                  f"{seconds:.1f} s (all ranks) | {'yes' if plan.composed else 'no'} |")


def torchtitan(schedule: str, ranks: list[int] | None = None, whole: bool = False, reshard: str = "always",
               float8: str = "none") -> None:
    """Llama 3.1 405B (126 blocks, 16384 wide, 128 heads over 8 key/value heads, MLP 53248, vocabulary 128256) as
    torchtitan trains it on 512 H100s: every pipeline rank's plan (or ``ranks``'; ``whole``: each run whole, not
    composed from a small step; ``reshard``: --fsdp-reshard-after-forward, torchtitan's own "torchtitan"; ``float8``:
    --float8, torchtitan's Float8 linears)."""
    from fitgpt.estimate.hardware import Target, find_gpu

    overrides = {"model": {"n_embed": 16384, "n_head": 128, "n_kv_head": 8, "ffn_hidden": 53248, "n_blocks": 126,
                           "vocab_size": 128256, "context_length": 8192, "tie_embeddings": False, "rope_theta": 500000.0},
                 "batch_size": 32, "pipeline_parallel": 8, "tensor_parallel": 8, "parallel": "fsdp",
                 "pipeline_schedule": schedule, "pipeline_microbatches": 32, "activation_checkpointing": "block",
                 "fsdp_reshard_after_forward": reshard, "float8": float8}
    cfg = load_config("llama-1b", overrides=overrides)
    t0 = time.perf_counter()
    plans = plan_pipeline(cfg, 512, torch.bfloat16, target=Target("cuda", find_gpu("h100-80gb")), ranks=ranks, whole=whole)
    wall = time.perf_counter() - t0
    gib = 2**30
    print(f"405B, FSDP 8 x TP 8 x PP 8, {schedule}, 32 micro-batches of 1 x 8192, block, bf16, H100, reshard after forward "
          f"{reshard}, float8 {float8}: planned in {wall:.0f} s")
    print("| rank | blocks | weights | gradients | AdamW state | receive buffers | activations | peak | peak (bytes) | "
          "planned in | composed |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for p in plans:
        print(f"| {p.rank} | {p.describe_blocks()} | {p.params / gib:.2f} | {p.grads / gib:.2f} | {p.optimizer / gib:.2f} | "
              f"{p.buffers / gib:.2f} | {p.activations / gib:.2f} | {p.peak / gib:.2f} GiB | {p.peak:,} | {p.seconds:.0f} s | "
              f"{'yes' if p.composed else 'no'} |")


if __name__ == "__main__":
    if "--torchtitan" in sys.argv:
        chosen = [int(r) for r in sys.argv[sys.argv.index("--ranks") + 1].split(",")] if "--ranks" in sys.argv else None
        reshard = sys.argv[sys.argv.index("--reshard") + 1] if "--reshard" in sys.argv else "always"
        float8 = sys.argv[sys.argv.index("--float8") + 1] if "--float8" in sys.argv else "none"
        torchtitan(sys.argv[sys.argv.index("--torchtitan") + 1], chosen, "--whole" in sys.argv, reshard, float8)
    else:
        check()
