"""The training loop: load data, resume, prepare the model (checkpointing, then compile, then DDP/FSDP),
then a short loop of the shared ``train_step``, evaluation and saves.

``train(cfg)`` is the entry point; ``_train`` reads as the recipe, each stage a function below it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from fitgpt.activation_checkpoint import Policy, apply_activation_checkpointing, parse_policy, remove_activation_checkpointing
from fitgpt.config import OptimConfig, TrainConfig, to_dict
from fitgpt.data import BatchSampler, TokenData, ensure_prepared
from fitgpt.data.prepare import adopt_prepared
from fitgpt.data.tokenizer import TOKENIZER_FILE
from fitgpt.device import autocast, autocast_dtype, peak_memory_bytes, resolve_device
from fitgpt.hf import check_tokenizer, import_config, import_weights
from fitgpt.memory import measure_step_memory
from fitgpt.memory.profile import PeakProbe
from fitgpt.memory.units import format_bytes
from fitgpt.model import ModelConfig, Transformer
from fitgpt.optim import build_optimizer, lr_at, optimizer_params
from fitgpt.step import StepResult, grad_scaler, train_step
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as dist_utils
from fitgpt.train.metrics import MetricsWriter, plot_loss_curve
from fitgpt.train.rundir import prepare_run_dir
from fitgpt.utils import DirLock

log = logging.getLogger(__name__)

# (config, device, autocast dtype, processes) -> {"policy": spec, "budget": bytes, "predicted_peak": bytes}
Planner = Callable[[TrainConfig, torch.device, "torch.dtype | None", int], dict]


class TrainingError(RuntimeError):
    """Training stopped for a reason the user can act on (divergence, out of memory)."""


def _rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class _StopFlag:
    """Ctrl-C or SIGTERM asks the loop to save and stop after the current step; a second one aborts."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict = {}

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:
            # A launcher (torchrun) forwards the user's Ctrl-C as a SIGTERM within milliseconds: only a
            # second signal that comes later is a person asking to abort without saving.
            if time.monotonic() - self._first > 2.0:
                raise KeyboardInterrupt
            return
        self.signal = signal.Signals(signum).name
        self._first = time.monotonic()
        log.warning("%s received: saving a checkpoint after this step (again to abort)", self.signal)

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def build_model(cfg: TrainConfig, vocab_size: int, device: torch.device) -> Transformer:
    torch.manual_seed(cfg.seed)
    model_cfg = dataclasses.replace(cfg.model, vocab_size=vocab_size)
    return Transformer(model_cfg).to(device)


def log_activation_memory(model: nn.Module, policy_spec: str, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> dict:
    """Measured activation bytes of one micro-batch under none and under the policy (RNG untouched)."""
    rng = _rng_state(device)
    result = {}
    for spec in ("none", policy_spec) if policy_spec != "none" else ("none",):
        apply_activation_checkpointing(model, spec)
        try:
            result[spec] = measure_step_memory(model, x, y).activation_bytes
        except torch.OutOfMemoryError:
            result[spec] = None
        model.zero_grad(set_to_none=True)
    _set_rng_state(rng, device)
    parts = [f"{k}: {v / 2**20:.1f} MiB" if v is not None else f"{k}: out of memory" for k, v in result.items()]
    log.info("activation memory of one micro-batch (%d x %d): %s", x.size(0), x.size(1), ", ".join(parts))
    return result


def _log_activation_memory(model: nn.Module, spec: str, cfg: TrainConfig, data: TokenData, device: torch.device) -> dict:
    x, y = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + 2).next_batch(device)
    return log_activation_memory(model, spec, x, y, device)


def _load_for_resume(path: Path, cfg: TrainConfig, model: nn.Module, tok_hash: str) -> tuple[dict, dict]:
    """Meta and state of checkpoint ``path``, its weights loaded into ``model``; CheckpointError if it is corrupt."""
    ck_meta = ckpt.verify_checkpoint(path)
    _check_same_model(path, ck_meta["config"]["model"], cfg)
    if ck_meta.get("data", {}).get("tokenizer_sha256") not in (None, tok_hash):
        raise ValueError(f"--resume {path}: the checkpoint was trained with another tokenizer than {cfg.data.path}")
    ckpt.load_weights(path, model)  # full weights, on every rank, before any sharding
    state = ckpt.load_state(path, [p.shape for p in optimizer_params(model)])
    return ck_meta, state


def _check_same_model(path: Path, saved: dict, cfg: TrainConfig) -> None:
    """The checkpoint's model must be the one this run builds: every ModelConfig setting but dropout (a change of
    trajectory, warned about below) is compared, a key older checkpoints lack as its default."""
    for f in dataclasses.fields(ModelConfig):
        had, now = saved.get(f.name, f.default), getattr(cfg.model, f.name)
        if f.name != "dropout" and had != now:
            raise ValueError(
                f"--resume {path}: the checkpoint has model.{f.name}={had!r}, this run asks for {now!r}; resume with "
                f"the run's own config (--config {cfg.run_dir / 'config.json'}) or set --model.{f.name.replace('_', '-')} {had}"
            )


# Settings whose change on resume makes the run differ from the uninterrupted one (the model's shape is checked apart).
_TRAJECTORY = ("batch_size", "grad_accum", "max_steps", "seed", "precision", "model.dropout", "data.dir") + tuple(
    f"optim.{f.name}" for f in dataclasses.fields(OptimConfig))


def _warn_changed_settings(saved: dict, cfg: TrainConfig) -> None:
    now = to_dict(cfg)
    changed = []
    for key in _TRAJECTORY:
        a, b = saved, now
        for part in key.split("."):
            a, b = a.get(part) if isinstance(a, dict) else None, b.get(part) if isinstance(b, dict) else None
        if a is not None and a != b:
            changed.append(f"{key} {a} -> {b}")
    if changed:
        log.warning("resuming with changed settings (%s): the run is no longer bitwise the uninterrupted one", ", ".join(changed))


@torch.no_grad()
def evaluate(model: nn.Module, data: TokenData, cfg: TrainConfig, device: torch.device, amp) -> float:
    """Mean val loss over cfg.eval_batches fixed batches (the same windows at every evaluation)."""
    was_training = model.training
    model.eval()
    sampler = BatchSampler(data.splits["val"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + 1)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = sampler.next_batch(device)
        with amp():
            _, loss = model(x, y)
        losses.append(loss.item())
    model.train(was_training)
    return float(np.mean(losses))


def train(cfg: TrainConfig, planner: Planner | None = None) -> dict:
    """Train per cfg and return a summary (steps, losses, time, run directory).

    ``planner`` turns --activation-checkpointing auto into a plan for this device and process count (the CLI hands
    in the planner's ``plan_for``; the loop itself never imports the planner). Under torchrun every rank
    runs this function; rank 0 alone logs, writes metrics and checkpoints.
    """
    info = dist_utils.init_distributed(cfg.device, cfg.dist_timeout)
    try:
        _check_launch(cfg, info)
        with contextlib.ExitStack() as held:
            def claim() -> None:  # one process writes a run directory: rank 0 holds its lock for the whole run
                held.enter_context(DirLock(cfg.run_dir, "--out-dir"))
                prepare_run_dir(cfg.run_dir, cfg.resume, cfg.overwrite, cfg.data.path)

            dist_utils.from_main(info, claim)
            summary = _train(cfg, info, planner)
            dist_utils.leave_together(info)
            return summary
    finally:
        dist_utils.shutdown(info)


def _check_launch(cfg: TrainConfig, info: dist_utils.DistInfo) -> None:
    """What can be refused before anything is written: the device, and settings this launch cannot honour."""
    resolve_device(cfg.device)
    if cfg.parallel == "fsdp" and not info.enabled:
        raise ValueError("--parallel fsdp shards the model across processes, and this is one: launch with torchrun "
                         "--nproc-per-node N (N >= 2), or use --parallel ddp (the default) to train in one process")
    if info.enabled and cfg.parallel == "fsdp" and cfg.compile:
        raise ValueError("--compile with --parallel fsdp is not supported yet; drop --compile or use --parallel ddp")


@dataclass
class _Run:
    """What the loop works with, set up once by ``_train``."""

    cfg: TrainConfig
    info: dist_utils.DistInfo
    device: torch.device
    data: TokenData
    model: nn.Module
    """The bare model (activation checkpointing applied in place): what is saved."""
    step_model: nn.Module
    """The model as it trains: compiled and/or wrapped in DDP/FSDP."""
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: BatchSampler
    amp: Callable
    policy: Policy
    planned: dict | None
    metrics: MetricsWriter | None
    tied: list[str]
    """Names of tensors the weight file leaves out, because another name holds the same tensor."""


@dataclass
class _Progress:
    step: int
    loss: float = float("nan")
    grad_norm: float = float("nan")
    val_loss: float | None = None
    bad_steps: int = 0
    checkpoint: Path | None = None
    interrupted: str | None = None


def _train(cfg: TrainConfig, info: dist_utils.DistInfo, planner: Planner | None) -> dict:
    device = dist_utils.local_device(info, resolve_device(cfg.device))
    dtype = autocast_dtype(cfg.precision, device)
    if not info.is_main:
        logging.getLogger("fitgpt").setLevel(logging.WARNING)  # one log, from rank 0
    if cfg.init_from and not cfg.resume:  # a resumed run's config.json already holds the imported model
        cfg = dataclasses.replace(cfg, model=import_config(cfg.init_from))
    data, cfg = _load_data(cfg, info)
    model = build_model(cfg, cfg.model.vocab_size, device)
    if cfg.init_from and not cfg.resume:
        check_tokenizer(cfg.init_from, cfg.data.path / TOKENIZER_FILE)
        import_weights(cfg.init_from, model)
        log.info("initialised from %s (%s, %d blocks x %d)", cfg.init_from, cfg.model.arch, cfg.model.n_blocks, cfg.model.n_embed)
    tied = ckpt.tied_names(model.state_dict())  # read before sharding hides which tensors are one
    scaler = grad_scaler(device, dtype)
    # Each rank samples its own windows; rank 0 draws exactly what a single process would.
    sampler = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + info.rank)
    start_step, state = _resume(cfg, info, model, scaler, sampler, device, data) if cfg.resume else (0, None)
    if info.is_main:
        _write_run_files(cfg)
    policy, planned = _choose_policy(cfg, planner, device, dtype, info)
    act = _log_activation_memory(model, policy.spec, cfg, data, device) if info.is_main else None
    step_model = prepare_model(model, policy, cfg, info, device, dtype)
    # Built after sharding: under FSDP the optimizer holds only this rank's shard of every state.
    # Offloaded, the parameters live in host memory and the optimizer steps there.
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu") if cfg.fsdp_offload else device)
    if state is not None:
        dist_utils.load_full_optimizer_state(optimizer, state["optimizer"])
    _log_start(cfg, info, model, device, dtype, start_step)
    metrics = MetricsWriter(cfg.run_dir, cfg.tensorboard, resume_step=start_step) if info.is_main else None
    run = _Run(cfg, info, device, data, model, step_model, optimizer, scaler, sampler, autocast(device, dtype), policy, planned,
               metrics, tied)
    t_start = time.perf_counter()
    try:
        progress = _loop(run, start_step)
    finally:
        if metrics:
            metrics.close()
    png = plot_loss_curve(metrics.path, cfg.run_dir / "loss.png") if metrics else None
    remove_activation_checkpointing(model)
    return {
        "run_dir": str(cfg.run_dir), "steps": progress.step, "train_loss": progress.loss, "val_loss": progress.val_loss,
        "seconds": time.perf_counter() - t_start, "interrupted": progress.interrupted,
        "checkpoint": str(progress.checkpoint) if progress.checkpoint else None, "loss_png": str(png) if png else None,
        "activation_bytes": act, "memory_plan": planned, "data_tokens": data.meta["train_tokens"], "world_size": info.world,
        "rank": info.rank,
    }


def _load_data(cfg: TrainConfig, info: dist_utils.DistInfo) -> tuple[TokenData, TrainConfig]:
    """The prepared tokens (rank 0 prepares them on first use), and cfg with the model's vocabulary set from them."""
    def prepare_once() -> None:  # on rank 0; the others wait for it (and stop with its error, if it has one)
        ensure_prepared(cfg.data, progress=cfg.progress)

    dist_utils.from_main(info, prepare_once)
    data = TokenData(cfg.data.path)
    data.check_context(cfg.model.context_length)
    cfg = dataclasses.replace(cfg, data=adopt_prepared(cfg.data, data.meta))  # config.json records the data's settings
    # Rounded up to a multiple of 64 for fast matmuls; a model started from elsewhere keeps its own.
    vocab_size = int(math.ceil(data.vocab_size / 64) * 64)
    if cfg.init_from:
        if data.vocab_size > cfg.model.vocab_size:
            raise ValueError(f"--init-from {cfg.init_from}: the data has {data.vocab_size} token ids, the model "
                             f"{cfg.model.vocab_size}; prepare the data with the model's tokenizer")
        vocab_size = cfg.model.vocab_size
    return data, dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def _resume(cfg: TrainConfig, info: dist_utils.DistInfo, model: nn.Module, scaler: torch.amp.GradScaler,
            sampler: BatchSampler, device: torch.device, data: TokenData) -> tuple[int, dict]:
    """Load weights, scaler, this rank's data position and RNG from --resume; returns (step, state)."""
    path, (ck_meta, state) = ckpt.resolve_resume(
        cfg.run_dir, cfg.resume, lambda p: _load_for_resume(p, cfg, model, data.tokenizer_sha256))
    scaler.load_state_dict(state["scaler"])
    ranks = ck_meta.get("world_size", 1)
    if ranks != info.world:
        log.warning("resuming a %d-process run on %d processes: the data order differs from the original run", ranks, info.world)
    samplers, rngs = ck_meta.get("sampler_ranks", [ck_meta["sampler"]]), state.get("rng_ranks", [state["rng"]])
    if info.rank < len(samplers):
        sampler.load_state_dict(samplers[info.rank])
    _set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0], device)
    step = ck_meta["step"]
    if step >= cfg.max_steps:
        raise ValueError(f"--resume {path}: the checkpoint is at step {step} and --max-steps is {cfg.max_steps}, so "
                         "there is nothing to train; raise --max-steps to continue (nothing was changed)")
    _warn_changed_settings(ck_meta["config"], cfg)
    log.info("resumed from %s at step %d", path, step)
    return step, state


def _write_run_files(cfg: TrainConfig) -> None:
    # resume and overwrite are what this invocation did, not settings of the run: `--config config.json` must not repeat them.
    (cfg.run_dir / "config.json").write_text(json.dumps(to_dict(dataclasses.replace(cfg, resume=None, overwrite=False)), indent=1))
    # The run keeps its own tokenizer, so sampling works even if the data directory moves.
    shutil.copyfile(cfg.data.path / "tokenizer.json", cfg.run_dir / "tokenizer.json")


def _choose_policy(cfg: TrainConfig, planner: Planner | None, device: torch.device, dtype: torch.dtype | None,
                   info: dist_utils.DistInfo) -> tuple[Policy, dict | None]:
    """The run's checkpointing policy; for auto, the planner's plan for this device and process count, made on
    rank 0 (its time model is measured, so ranks planning apart could choose apart) and shared."""
    if cfg.activation_checkpointing != "auto":
        return cfg.policy, None
    if planner is None:
        raise ValueError("--activation-checkpointing auto needs a planner: pass the planner's plan_for as train(cfg, planner=...)")
    planned = dist_utils.from_main(info, lambda: planner(cfg, device, dtype, info.world))
    return parse_policy(planned["policy"]), planned


def prepare_model(model: nn.Module, policy: Policy, cfg: TrainConfig, info: dist_utils.DistInfo, device: torch.device,
                  dtype: torch.dtype | None) -> nn.Module:
    """The one place a model is made ready to train, in this order on every rank: activation checkpointing
    (in place), then torch.compile, then DDP or FSDP. Returns the module the steps call."""
    apply_activation_checkpointing(model, policy)
    log.info("checkpointing %s", policy.describe(cfg.model.n_blocks))
    step_model = torch.compile(model) if cfg.compile else model
    return dist_utils.wrap(step_model, info, cfg.parallel, device, dtype if cfg.parallel == "fsdp" else None, cfg.fsdp_offload)


def _log_start(cfg: TrainConfig, info: dist_utils.DistInfo, model: nn.Module, device: torch.device, dtype: torch.dtype | None,
               start_step: int) -> None:
    log.info(
        "training %s (%.2fM params) on %s, %s, %d tokens/step (global batch %d = %d per micro-batch x %d accumulation x %d "
        "process%s%s), steps %d -> %d, run dir %s",
        cfg.preset, model.num_params() / 1e6, device, dtype or "fp32", _tokens_per_step(cfg, info),
        cfg.batch_size * cfg.grad_accum * info.world, cfg.batch_size, cfg.grad_accum, info.world, "es" if info.world > 1 else "",
        f", {cfg.parallel}" if info.enabled else "", start_step, cfg.max_steps, cfg.run_dir,
    )


def _tokens_per_step(cfg: TrainConfig, info: dist_utils.DistInfo) -> int:
    return cfg.batch_size * cfg.grad_accum * cfg.model.context_length * info.world


def _loop(run: _Run, start_step: int) -> _Progress:
    """Step, log, evaluate, save, until --max-steps or a signal.

    The steps' results stay on the device; they are read together (one host sync) at each log,
    evaluation or save point, where skipped (non-finite) steps are reported, or stop the run."""
    cfg, info = run.cfg, run.info
    p = _Progress(step=start_step)
    # disable=None hides the bar when stderr is not a terminal (CI logs, pipes).
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if cfg.progress and info.is_main else True, dynamic_ncols=True)
    t_log = time.perf_counter()
    run.model.train()
    # With --activation-checkpointing auto, the second step of this process is measured against the plan.
    probe_step = start_step + 1 if cfg.max_steps > start_step + 1 else start_step
    pending: list[tuple[int, float, StepResult]] = []  # (step, lr, result) not read on the host yet
    with _StopFlag() as stop:
        while p.step < cfg.max_steps:
            lr = lr_at(p.step, cfg.optim, cfg.max_steps)
            for group in run.optimizer.param_groups:
                group["lr"] = lr
            pending.append((p.step, lr, _step(run, p.step, probe=run.planned is not None and p.step == probe_step)))
            p.step += 1
            bar.update(1)
            last = p.step == cfg.max_steps
            log_due, eval_due = p.step % cfg.log_interval == 0 or last, p.step % cfg.eval_interval == 0 or last
            save_due = p.step % cfg.checkpoint_interval == 0 or last
            # A signal may reach one rank only: all of them stop, and save, at the same step (checked where
            # the ranks meet anyway, so that a step never waits on a collective for it).
            check_stop = not info.enabled or log_due or eval_due or save_due
            stopping = check_stop and dist_utils.any_rank(info, stop.signal is not None, run.device)
            if log_due or eval_due or save_due or stopping:
                applied = _read_results(run, p, pending)
                pending = []
                if info.is_main and log_due and applied:
                    t_log = _log_metrics(run, p, lr, bar, t_log)
            if eval_due:
                p.val_loss = evaluate(run.step_model, run.data, cfg, run.device, run.amp)
                if run.metrics:
                    run.metrics.write({"step": p.step, "val_loss": p.val_loss})
                log.info("step %d: train loss %.4f, val loss %.4f", p.step, p.loss, p.val_loss)
            if save_due or stopping:
                p.checkpoint = _save(run, p.step)
            if stopping:
                p.interrupted = stop.signal or ("SIGNAL" if p.step < cfg.max_steps else None)
                log.warning("stopped by %s at step %d; resume with --resume latest", stop.signal or "a signal on another rank", p.step)
                break
    bar.close()
    return p


def _read_results(run: _Run, p: _Progress, pending: list[tuple[int, float, StepResult]]) -> bool:
    """Read the pending steps' results in one host sync: the newest applied loss and gradient norm go to
    ``p``, each skipped step is reported (or stops the run). Returns whether the newest step was applied."""
    values = torch.stack([torch.stack([r.loss.float(), r.grad_norm.float(), r.applied.float()]) for _, _, r in pending]).tolist()
    for (step, lr, _), (loss, grad_norm, applied) in zip(pending, values):
        if applied:
            p.loss, p.grad_norm = loss, grad_norm
        else:
            _skip_bad_step(run, p, step, loss, grad_norm, lr)
    return bool(values[-1][2])


def _step(run: _Run, step: int, probe: bool) -> StepResult:
    """One shared ``train_step`` on this rank's next micro-batches; with ``probe``, its peak is checked against the plan."""
    cfg, info = run.cfg, run.info
    batches = [run.sampler.next_batch(run.device) for _ in range(cfg.grad_accum)]
    # Not under torch.compile off CUDA: compiled kernels allocate outside the tracker's view.
    measurable = not info.enabled and (run.device.type == "cuda" or not cfg.compile)
    peak = PeakProbe(run.model, run.optimizer) if probe and measurable else None
    try:
        with peak or contextlib.nullcontext():
            result = train_step(
                run.step_model, run.optimizer, batches, amp=run.amp, scaler=run.scaler, grad_clip=cfg.optim.grad_clip,
                # Gradients are reduced across ranks once, on the last micro-batch; every rank decides on the same loss.
                sync=lambda last: dist_utils.sync_context(run.step_model, cfg.parallel, last),
                reduce=lambda loss: dist_utils.all_mean_tensor(info, loss),
            )
    except torch.OutOfMemoryError:
        raise TrainingError(
            f"out of memory at step {step} (batch {cfg.batch_size} x {cfg.model.context_length}, checkpointing "
            f"{run.policy.spec!r}). Run `fitgpt plan --preset {cfg.preset} --batch-size {cfg.batch_size} --context "
            f"{cfg.model.context_length} --memory-budget <your GPU's memory>` for a plan that fits, or train with "
            "--activation-checkpointing auto --memory-budget <size>; a smaller --batch-size with a larger --grad-accum "
            "keeps the tokens per step"
        ) from None
    if peak is not None:
        run.planned["measured_peak"] = peak.result.peak
        log.info("auto: measured peak %s (%s) vs predicted %s, budget %s", format_bytes(peak.result.peak), peak.result.source,
                 format_bytes(run.planned["predicted_peak"]), format_bytes(run.planned["budget"]))
    return result


def _skip_bad_step(run: _Run, p: _Progress, step: int, loss: float, grad_norm: float, lr: float) -> None:
    """Step ``step`` had a non-finite loss or gradient and was not applied: warn, or stop after --max-bad-steps."""
    p.bad_steps += 1
    last = p.checkpoint or (ckpt.list_checkpoints(run.cfg.run_dir) or ["none"])[-1]
    message = f"loss is {loss} at step {step} (lr {lr:.3g}, grad norm {grad_norm:.3g}); last good checkpoint: {last}"
    if p.bad_steps > run.cfg.max_bad_steps:
        raise TrainingError(message + ". Lower --optim.lr, or allow skips with --max-bad-steps")
    log.warning("skipping bad step: %s", message)


def _log_metrics(run: _Run, p: _Progress, lr: float, bar: tqdm, t_log: float) -> float:
    """Write a metrics line and update the bar; returns the time of this log, for the next throughput."""
    now = time.perf_counter()
    tps = _tokens_per_step(run.cfg, run.info) * run.cfg.log_interval / max(now - t_log, 1e-9)
    peak = peak_memory_bytes(run.device)
    run.metrics.write({"step": p.step, "loss": p.loss, "lr": lr, "grad_norm": p.grad_norm, "tokens_per_s": tps, "peak_mem": peak})
    bar.set_postfix(loss=f"{p.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}", mem=f"{peak / 2**20:.0f}MiB")
    return now


def _save(run: _Run, step: int) -> Path | None:
    """Write checkpoint ``step``: collectives first, on every rank (full weights under FSDP, the optimizer
    state, every rank's data position and RNG); then rank 0 writes. A failed write stops every rank."""
    cfg, info = run.cfg, run.info
    weights = None
    if info.enabled and cfg.parallel == "fsdp":  # gathered to rank 0 only: the others never hold the whole state
        weights = {k: v for k, v in dist_utils.full_model_state(run.model, keep=info.is_main).items() if k not in run.tied}
    opt_state = (dist_utils.full_optimizer_state(run.optimizer, keep=info.is_main) if info.enabled
                 else run.optimizer.state_dict())
    samplers = dist_utils.gather_objects(info, run.sampler.state_dict())
    rngs = dist_utils.gather_objects(info, _rng_state(run.device))
    path, error = None, None
    if info.is_main:
        state = {"optimizer": opt_state, "scaler": run.scaler.state_dict(), "rng": rngs[0], "rng_ranks": rngs}
        meta = {"config": to_dict(cfg), "sampler": samplers[0], "sampler_ranks": samplers, "world_size": info.world,
                "data": {"dir": str(cfg.data.path), "tokenizer_sha256": run.data.tokenizer_sha256}}
        try:
            path = ckpt.save_checkpoint(cfg.run_dir, step, weights if weights is not None else run.model, state, meta, cfg.keep_last)
            log.info("saved %s", path)
        except ckpt.CheckpointSaveError as e:
            error = e
    if dist_utils.any_rank(info, error is not None, run.device):
        raise TrainingError(str(error) if error else "rank 0 could not write a checkpoint (see its log)") from error
    return path
