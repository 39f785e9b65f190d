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
from typing import Optional

import torch

from fitgpt.activation_checkpoint import apply_activation_checkpointing, parse_policy, remove_activation_checkpointing
from fitgpt.device import autocast
from fitgpt.errors import user_errors
from fitgpt.memory.flops import OpFlops
from fitgpt.memory.measure import measure_step_memory
from fitgpt.memory.profile import measure_train_step
from fitgpt.memory.units import parse_bytes
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer
from fitgpt.plan.profile import StepProfile, profile_model
from fitgpt.plan.solver import Plan, PlanError, predict, solve
from fitgpt.plan.timing import timed, token_batches
from fitgpt.plan.workload import WorkloadConfig
from fitgpt.step import grad_scaler, train_step
from fitgpt.utils import writable_dir

log = logging.getLogger(__name__)

DEFAULT_POLICIES = ("none", "block", "group:2", "every:2", "selective", "pointwise", "chunked-loss", "auto:50%")


@dataclass
class BenchConfig(WorkloadConfig):
    """Measure checkpointing policies on one model and batch: memory, FLOPs, time."""

    device: Optional[str] = "auto"
    """Where to measure: auto, cpu, cuda, cuda:1, mps (bench always runs real steps)."""
    policies: tuple[str, ...] = DEFAULT_POLICIES
    """Policies to compare (the first is the baseline); auto:50% frees half of none's activations, auto:6GiB plans for a budget."""
    repeats: int = 25
    """Timed steps per policy (medians are reported)."""
    warmup: int = 2
    """Untimed steps per policy before timing."""
    out_dir: str = "bench"
    """Where bench.json and bench.png go."""
    seed: int = 0

    @user_errors
    def __post_init__(self) -> None:
        super().__post_init__()
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError("--repeats must be at least 1 and --warmup at least 0")
        if self.target or self.gpu:
            raise ValueError("fitgpt bench measures real steps on this machine (--device); to plan for another "
                             "device use fitgpt plan --target/--gpu")
        if self.world_size != 1:
            raise ValueError("fitgpt bench measures one process; for per-rank memory under DDP or FSDP use "
                             "fitgpt plan --world-size N --parallel ddp|fsdp")
        if not self.policies:
            raise ValueError("--policies: give at least one policy")
        for spec in self.policies:
            if spec.startswith("auto"):
                _auto_target(spec)
            else:
                parse_policy(spec)


def _auto_target(spec: str) -> tuple[str, float]:
    """``auto:50%`` -> ("fraction", 0.5); ``auto:6GiB`` -> ("bytes", ...)."""
    _, _, arg = spec.partition(":")
    arg = arg.strip() or "50%"
    if arg.endswith("%"):
        try:
            frac = float(arg[:-1]) / 100
        except ValueError:
            frac = -1
        if not 0 < frac <= 1:
            raise ValueError(f"--policies {spec!r}: the percentage of none's activation memory must be in (0, 100]")
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
    kind, value = _auto_target(spec)
    none = predict(profile, Plan.uniform(profile.n_blocks, "none"))
    budget = int(value) if kind == "bytes" else none.peak - int((1 - value) * none.activations_end_of_forward)
    plan, pred = solve(profile, budget)
    return plan.spec(), budget, pred.peak


def _resolve_specs(cfg: BenchConfig, device: torch.device, dtype: torch.dtype | None
                   ) -> tuple[dict[str, tuple[str, int | None, int | None]], dict[str, str], StepProfile]:
    """Each policy's concrete spec (auto:... solved on the planner's profile), with budget and predicted peak for auto.
    The profile is the planner's own (on fake tensors on CPU, as ``plan`` and ``auto`` take it, with the time model
    calibrated on this device): its predicted step times stand beside the measured ones."""
    tcfg, mcfg = cfg.train_config(), cfg.model_config
    profile = profile_model(mcfg, tcfg.batch_size, mcfg.context_length, device, tcfg.optim, tcfg.grad_accum, dtype,
                            seed=cfg.seed, fake=device.type == "cpu", cost=cfg.cost_model())
    log.info("profiled in %.1fs (time model: %s)", profile.seconds, profile.time_source)
    specs: dict[str, tuple[str, int | None, int | None]] = {}
    skipped: dict[str, str] = {}
    for spec in cfg.policies:
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


def _profiled_plan(spec: str, profile: StepProfile) -> tuple[Plan, bool]:
    """The plan the profile can predict nearest to ``spec``: an option the profile lacks (offload, profiled only for
    CUDA, where it moves bytes; on a CPU it does nothing) counts as none, and the prediction as not exact."""
    plan, exact = Plan.from_policy(spec, profile.n_blocks)
    options = tuple(o if o in profile.blocks[0] else "none" for o in plan.blocks)
    return Plan(options, plan.head), exact and options == plan.blocks


def run_bench(cfg: BenchConfig) -> dict:
    """Measure every policy of ``cfg``; returns the rows and the setup (also written to bench.json)."""
    writable_dir(Path(cfg.out_dir), "--out-dir")  # before anything is measured
    tcfg = cfg.train_config()
    device, dtype = cfg.torch_device(), cfg.dtype()
    mcfg = cfg.model_config
    B, T, accum = tcfg.batch_size, mcfg.context_length, tcfg.grad_accum
    t_start = time.perf_counter()
    specs, skipped, profile = _resolve_specs(cfg, device, dtype)

    torch.manual_seed(cfg.seed)
    model = Transformer(mcfg).to(device)
    optimizer = build_optimizer(model, tcfg.optim, device)
    batches = token_batches(mcfg.vocab_size, accum, B, T, device, cfg.seed)
    # The trainer's own step: autocast, the fp16 loss scaler, clipping.
    step_kw = {"amp": autocast(device, dtype), "scaler": grad_scaler(device, dtype), "grad_clip": tcfg.optim.grad_clip}
    train_step(model, optimizer, batches, **step_kw)  # the optimizer state exists from here on, as in training
    measured = _measure(model, optimizer, batches, specs, step_kw)
    times = _time(model, optimizer, batches, specs, step_kw, cfg.warmup, cfg.repeats, device)

    rows = []
    for name, (spec, budget, predicted) in specs.items():
        med = statistics.median(times[name])
        m = measured[name]
        plan, exact = _profiled_plan(spec, profile)
        rows.append(BenchRow(policy=name, spec=spec, peak_bytes=m["peak_bytes"], activation_bytes=m["activation_bytes"],
                             flops=m["flops"], step_seconds=med, tokens_per_s=B * T * accum / med, times=times[name],
                             budget_bytes=budget, predicted_peak_bytes=predicted,
                             predicted_seconds=predict(profile, plan).step_time, predicted_exact=exact))
    result = {
        "setup": {
            "workload": cfg.describe(), "preset": tcfg.preset, "batch_size": B, "context": T, "grad_accum": accum,
            "device": str(device), "dtype": str(dtype or "fp32"), "params": sum(p.numel() for p in model.parameters()),
            "repeats": cfg.repeats, "warmup": cfg.warmup, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "machine": platform.platform(), "peak_source": next(iter(measured.values()))["peak_source"],
            "profile_seconds": profile.seconds, "seconds": time.perf_counter() - t_start,
            "skipped": skipped, "time_model": profile.time_source, "noise": timing_noise(times),
        },
        "rows": [r.__dict__ for r in rows],
    }
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    result["png"] = str(plot_bench(result, out / "bench.png"))
    return result


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower is better on both)."""
    front = []
    for i, (x, y) in enumerate(points):
        if not any((x2 <= x and y2 <= y) and (x2 < x or y2 < y) for j, (x2, y2) in enumerate(points) if j != i):
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def plot_bench(result: dict, path: Path) -> Path | None:
    """Peak memory against step time, a labelled point per policy, the Pareto front joined."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plotting is a convenience; bench.json holds the numbers
        log.warning("matplotlib is not installed: no %s", path)
        return None
    rows = result["rows"]
    pts = [(r["step_seconds"] * 1e3, r["peak_bytes"] / 2**20) for r in rows]
    front = pareto_front(pts)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in pts], [p[1] for p in pts], color="tab:gray", zorder=2)
    ax.plot([pts[i][0] for i in front], [pts[i][1] for i in front], "o-", color="tab:red", zorder=3, label="Pareto front")
    for r, (x, y) in zip(rows, pts):
        spec = r["spec"] if len(r["spec"]) <= 32 else r["spec"][:31] + "…"
        label = r["policy"] if r["policy"] == r["spec"] else f"{r['policy']}\n= {spec}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.margins(x=0.25, y=0.08)
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak memory of a step (MiB)")
    ax.set_title(result["setup"]["workload"], fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def timing_noise(times: dict[str, list[float]]) -> float:
    """The run's noise: per policy the median absolute deviation of its step times over their median, and of those
    the median. Two policies whose times differ by less than this are not told apart by the run."""
    rel = []
    for ts in times.values():
        med = statistics.median(ts)
        rel.append(statistics.median(abs(t - med) for t in ts) / med)
    return statistics.median(rel) if rel else 0.0


def format_table(result: dict) -> str:
    rows = result["rows"]
    base = rows[0]
    setup = result["setup"]
    lines = [
        f"{setup['workload']}; peak from the {setup['peak_source']}, median of {setup['repeats']} interleaved steps "
        f"(noise: {setup.get('noise', 0):.1%} median absolute deviation)",
        "",
        "| policy | peak (MiB) | activations (MiB) | GFLOPs/step | step (ms) | tokens/s | peak saved | activations saved | "
        f"time vs {base['policy']} | predicted | FLOPs vs {base['policy']} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = f"`{r['policy']}`" + (f" = `{r['spec']}`" if r["spec"] != r["policy"] else "")
        predicted = "-"
        if r.get("predicted_seconds") and base.get("predicted_seconds"):
            predicted = f"{r['predicted_seconds'] / base['predicted_seconds']:.2f}x" + ("" if r["predicted_exact"] else "*")
        lines.append(
            f"| {name} | {r['peak_bytes'] / 2**20:.1f} | {r['activation_bytes'] / 2**20:.1f} | {r['flops'] / 1e9:.1f} | "
            f"{r['step_seconds'] * 1e3:.0f} | {r['tokens_per_s']:.0f} | {1 - r['peak_bytes'] / base['peak_bytes']:.1%} | "
            f"{1 - r['activation_bytes'] / base['activation_bytes']:.1%} | {r['step_seconds'] / base['step_seconds']:.2f}x | "
            f"{predicted} | {r['flops'] / base['flops']:.3f}x |"
        )
    lines.append(f"\npredicted: the planner's step-time ratio ({setup.get('time_model') or 'no time model'})"
                 + ("; * the nearest plan the planner composes (groups as blocks recomputed alone, offload left out)"
                    if any(not r.get("predicted_exact", True) for r in rows) else ""))
    return "\n".join(lines)
