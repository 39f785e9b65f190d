"""Predictions against measurements: fake-tensor plans vs real steps, on this CPU or on a CUDA card.

    python benchmarks/plan_check.py cpu  [--out benchmarks/plan_check_cpu.json]
    python benchmarks/plan_check.py cuda [--out gpu_check/plan_check_cuda.json]
    torchrun --nproc-per-node 2 benchmarks/plan_check.py ranks [--out gpu_check/plan_check_ranks.json]

cpu: planning time (fake tensors vs the real-step profiler), fake-vs-real profile equality, and the
measured peak of a real training step against the fake prediction, for tiny, small and medium at
CPU-sized shapes. cuda: for tiny, small, medium, 3b and two Hugging Face models from their configs
(benchmarks/hf_configs: Qwen2.5 0.5B, Pythia 1B, random weights), the plan made on fake CPU tensors for this
card (`--target cuda --gpu <card>`) against torch.cuda.max_memory_allocated / max_memory_reserved of
real steps of that plan. ranks: under DDP and FSDP, each rank's step against the replay for one rank of N (on
GPUs; on a CPU it only runs the code). Each run prints a Markdown table and writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing
from fitgpt.cli.workload import BudgetConfig
from fitgpt.config import load_config
from fitgpt.device import autocast
from fitgpt.estimate.hardware import GPUS
from fitgpt.estimate.profile import profile_model
from fitgpt.estimate.source import as_source
from fitgpt.memory.timeline import measure_train_step
from fitgpt.optim import build_optimizer
from fitgpt.parallel.data import ddp_wrap, sync_context
from fitgpt.parallel.fsdp import fsdp_shard, precision_roles
from fitgpt.plan.largest import largest
from fitgpt.plan.solver import min_peak, solve
from fitgpt.step import grad_scaler, train_step
from fitgpt.train import distributed as du

GiB = 2**30


def _cli_seconds(args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "fitgpt", *args], check=True, capture_output=True)
    return time.perf_counter() - t


def measure(model, policy: str, batch: int, context: int, accum: int, dtype, device: torch.device,
            parallel: str | None = None) -> dict:
    """A steady-state step of ``policy`` as the replay models it: weights, a first step (optimizer state),
    then a measured one, each of min(accum, 2) micro-batches. CUDA: the allocator's peaks; CPU: live tensors.
    ``model``: a ModelConfig, or any model source (a Hugging Face config's). ``parallel``: ddp or fsdp, under
    torchrun, wrapped as the trainer wraps (``fitgpt.parallel``)."""
    source = as_source(model)
    if context > source.context_length:  # as the profile builds it
        source = source.at(context=context)
    model = source.build().to(device)
    apply_activation_checkpointing(model, policy)
    amp_dtype, param_dtype = precision_roles(dtype, parallel == "fsdp")
    step_model = (ddp_wrap(model, [device.index] if device.type == "cuda" else None) if parallel == "ddp"
                  else fsdp_shard(model, param_dtype) if parallel == "fsdp" else model)
    optimizer = build_optimizer(model, load_config("tiny").optim, device)
    kw = {"amp": autocast(device, amp_dtype), "scaler": grad_scaler(device, amp_dtype), "grad_clip": 1.0,
          "sync": lambda last: sync_context(step_model, last)}
    model = step_model

    def batches(n):
        x = torch.zeros(batch, context, dtype=torch.long, device=device)
        return [(x, x.clone()) for _ in range(n)]

    train_step(model, optimizer, batches(min(accum, 2)), **kw)
    measured = batches(min(accum, 2))  # made before the measurement: the prediction does not count the token batch
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        train_step(model, optimizer, measured, **kw)
        torch.cuda.synchronize()
        result = {"max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved()}
    else:
        result = {"max_allocated": measure_train_step(model, optimizer, measured, **kw).peak, "max_reserved": None}
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def cpu_check() -> dict:
    rows = []
    # Planning time: the default (fake) plan against the real-step profiler, same shape, same budget.
    for preset, b, t in (("small", 8, 256), ("medium", 4, 256)):
        args = ["plan", "--preset", preset, "--batch-size", str(b), "--context", str(t), "--memory-budget", "64GiB"]
        rows.append({"what": "plan time", "preset": preset, "shape": f"{b}x{t}", "fake_s": _cli_seconds(args),
                     "real_s": _cli_seconds(args + ["--device", "cpu"]) if preset == "small" else None})
    rows.append({"what": "plan time", "preset": "3b", "shape": "4x512 (preset)", "fake_s": _cli_seconds(
        ["plan", "--preset", "3b", "--target", "cuda", "--gpu", "h100-80gb", "--memory-budget", "80GiB"]), "real_s": None})
    # Fake vs real profiles, field by field, and real trained steps against the fake prediction.
    for preset, b, t, dtype in (("tiny", 8, 128, None), ("tiny", 8, 128, torch.bfloat16), ("small", 4, 256, None),
                                ("small", 4, 256, torch.bfloat16), ("medium", 2, 256, None), ("medium", 2, 256, torch.bfloat16)):
        cfg = load_config(preset)
        fake = profile_model(cfg.model, b, t, "cpu", cfg.optim, 1, dtype, fake=True)
        real = profile_model(cfg.model, b, t, "cpu", cfg.optim, 1, dtype) if preset == "tiny" or dtype is None else None
        a = dataclasses.asdict(fake)
        equal = None if real is None else sum(a[k] == v for k, v in dataclasses.asdict(real).items() if k != "seconds")
        none, lowest = solve(fake, 10**15)[1].peak, min_peak(fake)[1].peak
        budget = (none + lowest) // 2  # a budget that needs a mixed plan
        plan, pred = solve(fake, budget)
        m = measure(cfg.model, plan.spec(), b, t, 1, dtype, torch.device("cpu"))
        rows.append({"what": "step", "preset": preset, "shape": f"{b}x{t}", "dtype": str(dtype or "fp32"), "plan": plan.spec(),
                     "fields_equal": equal, "fields": len(a) - 1, "predicted": pred.peak,
                     "measured": m["max_allocated"], "error": m["max_allocated"] / pred.peak - 1})
    rows += fit_check("tiny", 4, 32, "24MiB") + fit_check("small", 1, 64, "2300MiB")
    return {"device": "cpu", "torch": torch.__version__, "rows": rows}


def fit_check(preset: str, batch: int, context: int, budget: str) -> list[dict]:
    """fit's batch answers for none and block, confirmed by real steps at n (fits) and n + 1 (does not)."""
    flags = BudgetConfig(preset=preset, batch_size=batch, context=context, grad_accum=1, memory_budget=budget)
    w, budget = flags.workload, flags.budget
    t = time.perf_counter()
    answers = largest(w, budget)["answers"]
    seconds = time.perf_counter() - t
    rows = []
    for policy in ("none", "block"):
        n = answers[policy]["batch_size"]
        got = [measure(w.train.model, policy, k, context, 1, None, torch.device("cpu"))["max_allocated"]
               for k in (n, n + 1)]
        rows.append({"what": "fit", "preset": preset, "shape": f"batch at context {context}", "dtype": "fp32",
                     "plan": policy, "fit_s": seconds, "budget": budget, "answer": n, "measured_n": got[0],
                     "measured_n1": got[1], "confirmed": got[0] <= budget < got[1]})
    return rows


def _card() -> str | None:
    name = torch.cuda.get_device_name().lower()
    keys = {"h100": "h100-80gb", "h200": "h200", "a100": "a100-80gb" if torch.cuda.get_device_properties(0).total_memory
            > 60 * GiB else "a100-40gb", "l4": "l4", "4090": "rtx-4090", "3090": "rtx-3090", "t4": "t4"}
    return next((v for k, v in keys.items() if k in name), None)


def cuda_check() -> dict:
    card = _card()
    total = torch.cuda.get_device_properties(0).total_memory
    rows = []
    hf = Path(__file__).parent / "hf_configs"
    for preset, b, t in (("tiny", 16, 128), ("small", 8, 1024), ("medium", 4, 1024), ("3b", 4, 512),
                         (hf / "qwen2.5-0.5b.json", 2, 2048), (hf / "pythia-1b.json", 4, 2048)):
        target = {"gpu": card} if card else {"target": "cuda", "memory_budget": f"{total // 2**20}MiB"}
        model = {"hf_config": str(preset)} if isinstance(preset, Path) else {"preset": preset}
        flags = BudgetConfig(batch_size=b, context=t, **model, **target)
        preset = preset.stem if isinstance(preset, Path) else preset
        w = flags.workload
        try:
            plan, pred = solve(w.profile(), flags.budget)
        except Exception as e:  # too large for this card under any plan
            rows.append({"preset": preset, "shape": f"{b}x{t}", "error": str(e)[:200]})
            continue
        replay = w.replay(plan.spec())
        m = measure(w.model, plan.spec(), b, t, w.train.grad_accum, w.dtype, torch.device("cuda"))
        predicted = pred.peak + w.target.workspace_bytes()
        rows.append({"preset": preset, "shape": f"{b}x{t}", "plan": plan.spec(), "predicted_allocated": predicted,
                     "replay_allocated": replay["max_allocated"], "replay_reserved": replay["max_reserved"], **m,
                     "error_allocated": m["max_allocated"] / replay["max_allocated"] - 1,
                     "error_reserved": m["max_reserved"] / replay["max_reserved"] - 1})
    return {"device": torch.cuda.get_device_name(), "card": card, "torch": torch.__version__, "rows": rows,
            "cards_known": list(GPUS)}


def ranks_check() -> dict:
    """Under torchrun (N processes; NCCL on GPUs, else gloo on this CPU, where only the code path is checked): each
    rank's step of the small preset, bf16, batch 4 x 512 and 2 micro-batches under ``block``, with DDP and with FSDP,
    against the plan's allocator replay for one rank of N (fake ranks, this card modelled, in a fresh process)."""
    cuda = torch.cuda.is_available()
    info = du.init_distributed("cuda" if cuda else "cpu", timeout_s=600)
    device = du.local_device(info, torch.device("cuda" if cuda else "cpu"))
    if cuda:
        torch.cuda.set_device(device)
    card = (_card() if cuda else None) or "h100-80gb"
    preset, b, t = ("small", 4, 512) if cuda else ("tiny", 4, 64)  # bf16 steps are slow on a CPU
    rows = []
    try:
        for parallel in ("ddp", "fsdp"):
            flags = BudgetConfig(preset=preset, batch_size=b, context=t, grad_accum=2, precision="bf16", gpu=card,
                                 world_size=info.world, parallel=parallel)
            w = flags.workload
            measured = du.gather_objects(info, measure(w.model, "block", b, t, 2, w.dtype, device, parallel))
            if info.is_main:
                replay = w.replay("block")
                rows += [{"parallel": parallel, "rank": r, "ranks": info.world, "plan": "block", "shape": f"{b}x{t} x 2",
                          "predicted_allocated": None, "replay_allocated": replay["max_allocated"],
                          "replay_reserved": replay["max_reserved"], **m, "preset": f"{preset}, {parallel} rank {r}",
                          "error_allocated": m["max_allocated"] / replay["max_allocated"] - 1,
                          "error_reserved": m["max_reserved"] / replay["max_reserved"] - 1 if m["max_reserved"] else None}
                         for r, m in enumerate(measured)]
    finally:
        du.shutdown(info)
    return {"device": torch.cuda.get_device_name() if cuda else "cpu (code path only)", "card": card,
            "torch": torch.__version__, "rows": rows, "main": info.is_main}


def _table(result: dict) -> str:
    rows = result["rows"]
    if result["device"] == "cpu":
        lines = ["| check | preset | shape | dtype | plan | fake s | real s | fields equal | predicted MiB | measured MiB | error |",
                 "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            if r["what"] == "fit":
                lines.append(f"| fit ({r['fit_s']:.0f} s) | {r['preset']} | {r['shape']} | | `{r['plan']}`: batch {r['answer']} | | | "
                             f"| budget {r['budget'] / 2**20:.1f} | n: {r['measured_n'] / 2**20:.2f}, n+1: "
                             f"{r['measured_n1'] / 2**20:.2f} | {'confirmed' if r['confirmed'] else 'WRONG'} |")
            elif r["what"] == "plan time":
                real = f"{r['real_s']:.1f}" if r["real_s"] else "-"
                lines.append(f"| plan time | {r['preset']} | {r['shape']} | | | {r['fake_s']:.1f} | {real} | | | | |")
            else:
                eq = f"{r['fields_equal']}/{r['fields']}" if r["fields_equal"] is not None else "-"
                lines.append(f"| step | {r['preset']} | {r['shape']} | {r['dtype']} | `{r['plan']}` | | | {eq} | "
                             f"{r['predicted'] / 2**20:.2f} | {r['measured'] / 2**20:.2f} | {r['error']:+.4%} |")
        return "\n".join(lines)
    lines = ["| preset | shape | plan | predicted alloc GiB | replay alloc GiB | measured alloc GiB | replay reserved GiB | "
             "measured reserved GiB | alloc error | reserved error |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['preset']} | {r['shape']} | {r['error']} | | | | | | | |")
            continue
        predicted = f"{r['predicted_allocated'] / GiB:.3f}" if r["predicted_allocated"] else "-"
        reserved = f"{r['max_reserved'] / GiB:.3f} | {r['error_allocated']:+.2%} | {r['error_reserved']:+.2%}" if r["max_reserved"] \
            else f"- | {r['error_allocated']:+.2%} | -"
        lines.append(f"| {r['preset']} | {r['shape']} | `{r['plan']}` | {predicted} | {r['replay_allocated'] / GiB:.3f} | "
                     f"{r['max_allocated'] / GiB:.3f} | {r['replay_reserved'] / GiB:.3f} | {reserved} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["cpu", "cuda", "ranks"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode == "cuda" and not torch.cuda.is_available():
        sys.exit("plan_check.py cuda: no CUDA device here")
    result = {"cpu": cpu_check, "cuda": cuda_check, "ranks": ranks_check}[args.mode]()
    if not result.pop("main", True):
        return  # under torchrun: rank 0 writes and prints
    out = Path(args.out or f"benchmarks/plan_check_{args.mode}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(_table(result))


if __name__ == "__main__":
    main()
