"""Tensor parallelism on gloo CPU ranks (issue 45): each rank's measured peak against the plan of one rank (fake ranks),
per policy, at 1 x 2, 2 x 2 (FSDP over the pairs) and 1 x 4, and FSDP alone on 2 and 4 for the step time beside them
(the same global batch of 4, each data-parallel rank its share); each block's kept activation bytes per rank beside
Korthikanti et al.'s formulas; and the step time on this CPU against one process.

    python benchmarks/tp_check.py            # a few minutes on 2 cores
    TP_CHECK_ARCH=gpt2 python benchmarks/tp_check.py   # GPT-2's block (split alone: 1 x 2, 1 x 4)
    python benchmarks/tp_check.py --largest 5   # the deepest model a rank of 4 fits in 5 GiB, per layout (planned)

Prints Markdown tables for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.estimate.profile import profile_model
from fitgpt.memory.timeline import measure_train_step
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer
from fitgpt.parallel.tensor import apply_tensor_parallel, step_context
from fitgpt.plan import Plan, predict

# Llama, 8 heads sharing 4 key/value heads, 256 wide, 4 blocks, untied; batch 4 x 256.
CFG = ModelConfig(arch="llama", vocab_size=2048, context_length=256, n_embed=256, n_head=8, n_kv_head=4, n_blocks=4,
                  dropout=0.0, tie_embeddings=False)
if os.environ.get("TP_CHECK_ARCH") == "gpt2":  # an environment variable, which the spawned ranks read too
    CFG = dataclasses.replace(CFG, arch="gpt2", n_kv_head=None)
B = 4  # the global batch: each data-parallel rank its share
POLICIES = ("none", "block", "selective", "block+chunked-loss", "block+fused-loss")  # the loss heads: the head's logits
# sharded on the vocabulary, in chunks (of the default 1,024 rows: one a step here)
LAYOUTS = ((2, 2), (4, 2), (4, 4), (2, 1), (4, 1))  # (processes, TP degree): 1 x 2, 2 x 2, 1 x 4, FSDP 2, FSDP 4
if CFG.arch == "gpt2":  # split alone: FSDP over GPT-2's split is refused
    LAYOUTS = tuple(layout for layout in LAYOUTS if layout != (4, 2))


def _batch(rows: int = B):
    idx = torch.randint(0, CFG.vocab_size, (rows, CFG.context_length + 1), generator=torch.Generator().manual_seed(1))
    return [(idx[:, :-1].contiguous(), idx[:, 1:].contiguous())]


def _worker(rank: int, world: int, port: int, out: str, tp: int) -> None:
    """world / tp data-parallel ranks (FSDP's, where more than one; each its share of the batch) x tp."""
    from fitgpt.parallel.fsdp import fsdp_shard
    from fitgpt.parallel.tensor import training_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        mesh, dp = training_mesh("cpu", world, tp), world // tp
        rows = {}
        for spec in POLICIES:
            torch.manual_seed(0)
            model = Transformer(CFG)
            if tp > 1:
                apply_tensor_parallel(model, mesh["tp"])
            apply_activation_checkpointing(model, spec)
            if dp > 1:
                fsdp_shard(model, None, mesh=mesh["dp"])
            opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
            with step_context(model):
                measure_train_step(model, opt, _batch(B // dp), grad_clip=1.0)
                t0 = time.perf_counter()
                peak = measure_train_step(model, opt, _batch(B // dp), grad_clip=1.0).peak
                rows[spec] = (peak, time.perf_counter() - t0)
        torch.save(rows, f"{out}.{rank}")
        dist.barrier()  # every rank's work is done
    except BaseException:
        dist.destroy_process_group()
        raise
    # Out at once, as tests/test_sharded_init.py's helper leaves: tearing gloo ranks down on 2 cores aborted one now
    # and then ("terminate called without an active exception", SIGABRT) after its work was done, barrier or not.
    os._exit(0)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_process() -> dict[str, float]:
    times = {}
    for spec in POLICIES:
        torch.manual_seed(0)
        model = Transformer(CFG)
        apply_activation_checkpointing(model, spec)
        opt = build_optimizer(model, OptimConfig(), torch.device("cpu"))
        measure_train_step(model, opt, _batch(), grad_clip=1.0)
        t0 = time.perf_counter()
        measure_train_step(model, opt, _batch(), grad_clip=1.0)
        times[spec] = time.perf_counter() - t0
    return times


def _korthikanti(tp: int) -> dict[str, float]:
    """Bytes a layer keeps in fp32 by their formulas (they count 2-byte activations: doubled here), s x b x h."""
    s, b, h, a = CFG.context_length, B, CFG.n_embed, CFG.n_head
    sbh = s * b * h
    return {"none, no TP": 2 * sbh * (34 + 5 * a * s / h),
            "none, TP": 2 * sbh * (10 + 24 / tp + 5 * a * s / (h * tp)),
            "none, TP + SP": 2 * sbh / tp * (34 + 5 * a * s / h),
            "block (full recompute), TP + SP": 2 * 2 * sbh / tp}


def main() -> None:
    whole = profile_model(CFG, B, CFG.context_length, "cpu", OptimConfig(), fake=True)
    one = _one_process()
    print("| layout | policy | rank | measured peak | predicted peak | equal | kept a block (predicted) | step s | vs one process |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|")
    for spec in POLICIES:
        pred = predict(whole, Plan.from_policy(spec, CFG.n_blocks)[0])
        kept = whole.blocks[1][spec.split("+")[0]].saved
        print(f"| one process | {spec} | 0 | - | {pred.peak:,} | | {kept:,} | {one[spec]:.3f} | 1.00x |")
    for world, tp in LAYOUTS:
        dp, layout = world // tp, f"{world // tp} x {tp}" if tp > 1 else f"FSDP {world}"
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "rows")
            mp.spawn(_worker, args=(world, _port(), out, tp), nprocs=world, join=True)
            measured = [torch.load(f"{out}.{r}") for r in range(world)]
        profile = profile_model(CFG, B // dp, CFG.context_length, "cpu", OptimConfig(), fake=True, tp_ranks=tp,
                                fsdp_ranks=dp)
        for spec in POLICIES:
            pred = predict(profile, Plan.from_policy(spec, CFG.n_blocks)[0]).peak
            kept = profile.blocks[1][spec.split("+")[0]].saved
            for r, rows in enumerate(measured):
                peak, secs = rows[spec]
                print(f"| {layout} | {spec} | {r} | {peak:,} | {pred:,} | {'=' if peak == pred else f'{peak - pred:+,}'} | "
                      f"{kept:,} | {secs:.3f} | {secs / one[spec]:.2f}x |", flush=True)
    print()
    print("| Korthikanti et al. (2022), a layer, fp32 | tp = 2 | tp = 4 |")
    print("|---|---:|---:|")
    k2, k4 = _korthikanti(2), _korthikanti(4)
    for name in k2:
        print(f"| {name} | {k2[name]:,.0f} | {k4[name]:,.0f} |")


def _shape(width: int, n_blocks: int) -> ModelConfig:
    """CFG's Llama at ``width`` (heads of 64, twice as many as key/value heads) and ``n_blocks``, context 1024."""
    return dataclasses.replace(CFG, n_embed=width, n_head=width // 64, n_kv_head=width // 128, n_blocks=n_blocks,
                               context_length=1024)


def _rank_peak(width: int, n_blocks: int, world: int, tp: int) -> int:
    """One rank's planned peak under `block`, fp32, AdamW, a global batch of 4 x 1024 over world / tp groups."""
    dp = world // tp
    p = profile_model(_shape(width, n_blocks), 4 // dp, 1024, "cpu", OptimConfig(), fake=True, tp_ranks=tp, fsdp_ranks=dp)
    return predict(p, Plan.uniform(n_blocks, "block")).peak


def largest(budget: int, widths: tuple[int, ...]) -> None:
    """The deepest Llama of each width whose rank's planned peak fits ``budget`` on 4 ranks, under FSDP 4, 2 x 2 and
    1 x 4: a binary search over depth on fake ranks."""
    print("| width | layout | blocks | parameters | peak a rank, planned |")
    print("|---:|---|---:|---:|---:|")
    for width in widths:
        for world, tp in ((4, 1), (4, 2), (4, 4)):
            lo, hi = 0, 1
            while _rank_peak(width, hi, world, tp) <= budget:
                lo, hi = hi, hi * 2
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if _rank_peak(width, mid, world, tp) <= budget else (lo, mid)
            layout = f"{world // tp} x {tp}" if tp > 1 else f"FSDP {world}"
            if not lo:
                print(f"| {width} | {layout} | 0 | - | - |", flush=True)
                continue
            with torch.device("meta"):
                n_params = Transformer(_shape(width, lo)).num_params(non_embedding=False)
            print(f"| {width} | {layout} | {lo} | {n_params / 1e6:,.0f}M | "
                  f"{_rank_peak(width, lo, world, tp) / 2**30:.2f} GiB |", flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--largest", metavar="BYTES", type=float,
                    help="instead: the deepest model a rank of 4 fits in this many GiB, per layout")
    args = ap.parse_args()
    if args.largest:
        largest(int(args.largest * 2**30), (1024, 2048))
    else:
        main()
