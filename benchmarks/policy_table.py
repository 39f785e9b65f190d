"""Counted (not timed) activation bytes and FLOPs of each checkpointing policy on one model and batch.

    python benchmarks/policy_table.py --preset small --batch-size 8 --context 256

Prints a markdown table, then one JSON line last. Bytes come from a live-storage tracker, FLOPs from
FlopCounterMode (matmuls and attention), both for one forward + backward in fp32 on CPU.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

import fitgpt.memory.flops  # noqa: F401  (registers the CPU attention FLOP formula)
from fitgpt.checkpointing import apply_checkpointing, remove_checkpointing
from fitgpt.memory import measure_step_memory
from fitgpt.model import Transformer
from fitgpt.train.config import load_config

POLICIES = ["none", "block", "group:2", "every:2", "sqrt", "selective", "chunked-loss", "block+chunked-loss", "selective+chunked-loss"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated; use ';' inside none")
    args = ap.parse_args()
    cfg = load_config(args.preset).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (args.batch_size, args.context), generator=g)
    rows = []
    for spec in args.policies.split(","):
        apply_checkpointing(model, spec)
        t0 = time.perf_counter()
        with FlopCounterMode(display=False) as fc:
            mem = measure_step_memory(model, idx, idx, blocks=model.attn_blocks)
        rows.append({"policy": spec, "activation_bytes": mem.activation_bytes, "block_bytes": sum(mem.block_bytes),
                     "peak_bytes": mem.peak_bytes, "flops": fc.get_total_flops(), "seconds": time.perf_counter() - t0})
        remove_checkpointing(model)
    base = rows[0]
    print(f"{args.preset} preset ({model.num_params() / 1e6:.0f}M params), batch {args.batch_size} x context {args.context}, fp32, "
          f"one forward + backward, counted\n")
    print("| policy | activations (MiB) | of none | block activations (MiB) | peak during step (MiB) | GFLOPs | FLOPs vs none |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['policy']}` | {r['activation_bytes'] / 2**20:.1f} | {r['activation_bytes'] / base['activation_bytes']:.1%} | "
              f"{r['block_bytes'] / 2**20:.1f} | {r['peak_bytes'] / 2**20:.1f} | {r['flops'] / 1e9:.1f} | {r['flops'] / base['flops']:.3f}x |")
    print(json.dumps({"preset": args.preset, "batch_size": args.batch_size, "context": args.context, "rows": rows}))


if __name__ == "__main__":
    main()
