"""`fitgpt bench`: every policy on one model and batch, measured side by side.

Per policy: the peak of a whole training step (forward, backward, optimizer), the activation bytes
held at the end of the forward pass, FLOPs, and the median step time. Timing is interleaved (one
step of each policy in turn, repeated), so that machine noise falls on all policies alike.
``auto:50%`` plans for a budget that frees half of ``none``'s activation memory; ``auto:6GiB``
plans for that many bytes.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.bench.report import plot_bench
from fitgpt.device import autocast
from fitgpt.errors import UserError
from fitgpt.estimate.profile import StepProfile, named_options
from fitgpt.estimate.timing import timed, token_batches
from fitgpt.estimate.workload import Workload
from fitgpt.memory.flops import OpFlops
from fitgpt.memory.measure import measure_step_memory
from fitgpt.memory.picture import draw
from fitgpt.memory.snapshot import MeasuredSnapshot, write_snapshot
from fitgpt.memory.timeline import measure_train_step
from fitgpt.optim import build_optimizer
from fitgpt.plan.solver import Plan, PlanError, predict, solve
from fitgpt.step import grad_scaler, train_step
from fitgpt.units import parse_bytes
from fitgpt.utils import writable_dir

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("none", "block", "group:2", "every:2", "selective", "pointwise", "chunked-loss", "pointwise+fused-loss",
                    "auto:50%")


def auto_target(spec: str) -> tuple[str, float]:
    """``auto:50%`` -> ("fraction", 0.5); ``auto:6GiB`` -> ("bytes", ...)."""
    _, _, arg = spec.partition(":")
    arg = arg.strip() or "50%"
    if arg.endswith("%"):
        try:
            frac = float(arg[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 1:
            raise UserError(f"--policies {spec!r}: the percentage of none's activation memory must be in (0, 100]")
        return "fraction", frac
    return "bytes", float(parse_bytes(arg, flag=f"--policies {spec}"))


@dataclass
class BenchRow:
    policy: str
    spec: str
    peak_bytes: int
    activation_bytes: int
    flops: int
    step_seconds: float
    tokens_per_s: float
    times: list[float] = field(default_factory=list)
    budget_bytes: int | None = None
    predicted_peak_bytes: int | None = None
    predicted_seconds: float | None = None
    """The planner's step time for this policy (its time model), to set against the measured one."""
    predicted_exact: bool = True
    """False where the policy is not a plan the planner composes (groups, offload): the nearest plan's time."""


def _resolve_auto(spec: str, profile: StepProfile) -> tuple[str, int, int]:
    kind, value = auto_target(spec)
    none = predict(profile, Plan.uniform(profile.n_blocks, "none"))
    budget = int(value) if kind == "bytes" else none.peak - int((1 - value) * none.activations_end_of_forward)
    plan, pred = solve(profile, budget)
    return plan.spec(), budget, pred.peak


def _resolve_specs(w: Workload, policies: tuple[str, ...]
                   ) -> tuple[dict[str, tuple[str, int | None, int | None]], dict[str, str], StepProfile]:
    """Each policy's concrete spec (auto:... solved on the planner's profile), with budget and predicted peak for auto.
    The profile is the planner's own (``w``: on fake tensors on CPU, as ``plan`` and ``auto`` take it, with the time
    model calibrated on this device): its predicted step times stand beside the measured ones."""
    profile = w.profile(extra_options=named_options(*policies))  # torchtitan's rule is profiled when a policy names it
    log.info("profiled in %.1fs (time model: %s)", profile.seconds, profile.time_source)
    specs: dict[str, tuple[str, int | None, int | None]] = {}
    skipped: dict[str, str] = {}
    for spec in policies:
        if ("chunked-loss" in spec or "fused-loss" in spec) and not w.model.chunked_head:
            skipped[spec] = "a chunked or fused loss needs fitgpt's head (lm_head(x, targets)); this model computes its own loss"
            continue
        if not spec.startswith("auto"):
            specs[spec] = (spec, None, None)
            continue
        try:
            specs[spec] = _resolve_auto(spec, profile)
        except PlanError as e:
            log.warning("%s: %s", spec, e)
            skipped[spec] = str(e)
            continue
        log.info("%s -> %s", spec, specs[spec][0])
    return specs, skipped, profile


def _measure(model, optimizer, batches, specs: dict, step_kw: dict) -> dict[str, dict]:
    """Per policy: activation bytes and FLOPs of one micro-batch's forward + backward, and the whole step's peak."""
    measured: dict[str, dict] = {}
    for name, (spec, _, _) in specs.items():
        apply_activation_checkpointing(model, spec)
        with step_kw["amp"](), OpFlops() as fl:
            act = measure_step_memory(model, *batches[0]).activation_bytes
        model.zero_grad(set_to_none=True)
        peak = measure_train_step(model, optimizer, batches, **step_kw)
        measured[name] = {"activation_bytes": act, "flops": fl.total * len(batches), "peak_bytes": peak.peak,
                          "peak_source": peak.source}
        remove_activation_checkpointing(model)
    return measured


def _time(model, optimizer, batches, specs: dict, step_kw: dict, warmup: int, repeats: int, device: torch.device
          ) -> dict[str, list[float]]:
    """Seconds per step of each policy, interleaved round by round so that noise hits every policy alike."""
    times: dict[str, list[float]] = {name: [] for name in specs}
    for r in range(warmup + repeats):
        for name, (spec, _, _) in specs.items():
            apply_activation_checkpointing(model, spec)
            seconds = timed(lambda: train_step(model, optimizer, batches, **step_kw), device)
            if r >= warmup:
                times[name].append(seconds)
            remove_activation_checkpointing(model)
    return times


def run_bench(w: Workload, policies: tuple[str, ...], out_dir: str | Path, warmup: int = 2, repeats: int = 25) -> dict:
    """Measure every policy on ``w``'s device (real steps, its model, batch and precision); returns the rows and the
    setup (also written to ``out_dir``/bench.json)."""
    out = writable_dir(Path(out_dir), "--out-dir")  # before anything is measured
    tcfg, device, dtype = w.train, w.device, w.dtype
    B, T, accum = tcfg.batch_size, w.context, tcfg.grad_accum
    t_start = time.perf_counter()
    specs, skipped, profile = _resolve_specs(w, policies)

    torch.manual_seed(tcfg.seed)
    model = w.model.build().to(device)
    optimizer = build_optimizer(model, tcfg.optim, device)
    batches = token_batches(w.model.vocab_size, accum, B, T, device, tcfg.seed)
    # The trainer's own step: autocast, the fp16 loss scaler, clipping.
    step_kw = {"amp": autocast(device, dtype), "scaler": grad_scaler(device, dtype), "grad_clip": tcfg.optim.grad_clip}
    train_step(model, optimizer, batches, **step_kw)  # the optimizer state exists from here on, as in training
    measured = _measure(model, optimizer, batches, specs, step_kw)
    times = _time(model, optimizer, batches, specs, step_kw, warmup, repeats, device)

    rows = []
    for name, (spec, budget, predicted) in specs.items():
        med = statistics.median(times[name])
        m = measured[name]
        plan, exact = Plan.profiled(spec, profile)
        rows.append(BenchRow(policy=name, spec=spec, peak_bytes=m["peak_bytes"], activation_bytes=m["activation_bytes"],
                             flops=m["flops"], step_seconds=med, tokens_per_s=B * T * accum / med, times=times[name],
                             budget_bytes=budget, predicted_peak_bytes=predicted,
                             predicted_seconds=predict(profile, plan).step_time, predicted_exact=exact))
    result = {
        "setup": {
            "workload": w.describe(f"measured on {device}"), "preset": tcfg.preset, "batch_size": B, "context": T, "grad_accum": accum,
            "device": str(device), "dtype": str(dtype or "fp32"), "params": sum(p.numel() for p in model.parameters()),
            "repeats": repeats, "warmup": warmup, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.platform(), "peak_source": next(iter(measured.values()))["peak_source"],
            "profile_seconds": profile.seconds, "seconds": time.perf_counter() - t_start,
            "skipped": skipped, "time_model": profile.time_source, "noise": timing_noise(times),
        },
        "rows": [r.__dict__ for r in rows],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    result["png"] = str(plot_bench(result, out / "bench.png"))
    memory = _memory_picture(w, model, optimizer, batches, specs, step_kw, out)
    result["memory_png"] = str(memory) if memory else None
    return result


def _memory_picture(w: Workload, model, optimizer, batches, specs: dict, step_kw: dict, out: Path) -> Path | None:
    """memory.png: per policy (the first three), a measured step (its snapshot: the allocator's history on CUDA, the
    live-tensor tracker elsewhere) above the predicted one, on one scale."""
    panels = []
    for name, (spec, _, _) in list(specs.items())[:3]:
        apply_activation_checkpointing(model, spec)
        with MeasuredSnapshot(model, optimizer, w.device) as rec:
            train_step(model, optimizer, batches, **step_kw)
        remove_activation_checkpointing(model)
        write_snapshot(rec.snapshot, out / f"memory_{name.replace(':', '_')}.pickle")
        panels += [(f"{name}: measured (one step)", rec.snapshot), (f"{name}: predicted (two steps)", w.snapshot(spec))]
    return draw(panels, out / "memory.png", title=w.describe(f"measured on {w.device}"), rows=2)


def timing_noise(times: dict[str, list[float]]) -> float:
    """The run's noise: per policy the median absolute deviation of its step times over their median, and of those
    the median. Two policies whose times differ by less than this are not told apart by the run."""
    rel = []
    for ts in times.values():
        med = statistics.median(ts)
        rel.append(statistics.median(abs(t - med) for t in ts) / med)
    return statistics.median(rel) if rel else 0.0
