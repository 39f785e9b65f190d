"""Each rank's measured peak under DDP/FSDP on CPU (gloo, N processes) against the planner's prediction for one rank.

    python benchmarks/fsdp_check.py [--worlds 2 4]

The prediction is profiled on fake ranks in this process (``profile_model(..., fsdp_ranks=N)``); the measurement is
each rank's second step under the live-tensor tracker, in N real processes, sharded by the trainer's own code. Prints
a Markdown table (the one in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile

import torch
import torch.multiprocessing as mp

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.profile import profile_model
from fitgpt.memory.timeline import measure_train_step
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer
from fitgpt.parallel.fsdp import precision_roles
from fitgpt.plan import Plan, predict
from fitgpt.train import distributed as du

CPU = torch.device("cpu")
B, T = 8, 128
MODELS = {"gpt2": ModelConfig(vocab_size=2048, context_length=T, n_embed=128, n_head=4, n_blocks=4),
          "llama (GQA 4:2)": ModelConfig(arch="llama", vocab_size=2048, context_length=T, n_embed=128, n_head=4, n_kv_head=2,
                                         n_blocks=4)}
PLANS = {"none": Plan.uniform(4, "none"), "block+chunked-loss": Plan.uniform(4, "block", "chunked"),
         "selective": Plan.uniform(4, "selective"), "pointwise": Plan.uniform(4, "pointwise"),
         "mixed (as auto picks)": Plan(("block", "none", "selective", "pointwise"))}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def _cases():
    return [(m, d, p) for m in MODELS for d in DTYPES for p in PLANS]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    info = du.init_distributed("cpu", timeout_s=300)
    try:
        rows = []
        for m, d, p in _cases():
            cfg, dtype = MODELS[m], DTYPES[d]
            x = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(rank))
            model = Transformer(cfg)
            apply_activation_checkpointing(model, PLANS[p].spec())
            step_model = du.wrap(model, info, "fsdp", CPU, dtype)
            opt = build_optimizer(model, OptimConfig(), CPU)
            amp = autocast(CPU, precision_roles(dtype, True)[0])  # as the trainer: pure bf16 under FSDP
            measure_train_step(step_model, opt, [(x, x)], amp=amp)
            rows.append(measure_train_step(step_model, opt, [(x, x)], amp=amp).peak)
        torch.save(rows, os.path.join(out, f"rank{rank}.pt"))
    finally:
        du.shutdown(info)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = ap.parse_args()
    print("| ranks | model | params | plan | predicted per rank | measured, every rank | error |")
    print("|---:|---|---|---|---:|---|---:|")
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as out, socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            mp.spawn(_worker, args=(world, port, out), nprocs=world, join=True)
            measured = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
        profiles = {}
        for i, (m, d, p) in enumerate(_cases()):
            if (m, d) not in profiles:
                profiles[m, d] = profile_model(MODELS[m], B, T, "cpu", dtype=DTYPES[d], fake=True, fsdp_ranks=world)
            predicted = predict(profiles[m, d], PLANS[p]).peak
            ranks = sorted({measured[r][i] for r in range(world)})
            error = max(abs(v - predicted) for v in ranks) / predicted
            print(f"| {world} | {m} | {d} | {p} | {predicted:,} | {' / '.join(f'{v:,}' for v in ranks)} | {error:.2%} |")


if __name__ == "__main__":
    main()
