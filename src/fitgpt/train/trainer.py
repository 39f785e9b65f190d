"""The training loop: prepare the model (checkpointing, then compile), step, evaluate, checkpoint.

One function, ``train(cfg)``, that a student can read top to bottom.
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
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

# safetensors' own rule for which name of a tied tensor it writes, so gathered FSDP weights match save_model's files.
from safetensors.torch import _remove_duplicate_names
from tqdm.auto import tqdm

from fitgpt.checkpointing import apply_checkpointing, parse_policy, remove_checkpointing
from fitgpt.config import OptimConfig, TrainConfig, to_dict
from fitgpt.data import BatchSampler, TokenData, ensure_prepared
from fitgpt.device import autocast, autocast_dtype, peak_memory_bytes, resolve_device
from fitgpt.memory import measure_step_memory
from fitgpt.memory.profile import PeakProbe
from fitgpt.memory.units import format_bytes
from fitgpt.model import Transformer
from fitgpt.optim import build_optimizer, lr_at, optimizer_params
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
        apply_checkpointing(model, spec)
        try:
            result[spec] = measure_step_memory(model, x, y).activation_bytes
        except torch.OutOfMemoryError:
            result[spec] = None
        model.zero_grad(set_to_none=True)
    _set_rng_state(rng, device)
    parts = [f"{k}: {v / 2**20:.1f} MiB" if v is not None else f"{k}: out of memory" for k, v in result.items()]
    log.info("activation memory of one micro-batch (%d x %d): %s", x.size(0), x.size(1), ", ".join(parts))
    return result


def _load_for_resume(path: Path, cfg: TrainConfig, model: nn.Module, tok_hash: str) -> tuple[dict, dict]:
    """Meta and state of checkpoint ``path``, its weights loaded into ``model``; CheckpointError if it is corrupt."""
    ck_meta = ckpt.verify_checkpoint(path)
    saved_model = ck_meta["config"]["model"]
    for key in ("vocab_size", "context_length", "n_embed", "n_head", "n_blocks", "bias"):
        if key in saved_model and saved_model[key] != getattr(cfg.model, key):
            raise ValueError(
                f"--resume {path}: the checkpoint has model.{key}={saved_model[key]}, this run asks for "
                f"{getattr(cfg.model, key)}; resume with the run's own config (--config {cfg.run_dir / 'config.json'})"
            )
    if ck_meta.get("data", {}).get("tokenizer_sha256") not in (None, tok_hash):
        raise ValueError(f"--resume {path}: the checkpoint was trained with another tokenizer than {cfg.data.path}")
    ckpt.load_weights(path, model)  # full weights, on every rank, before any sharding
    state = ckpt.load_state(path, [p.shape for p in optimizer_params(model)])
    return ck_meta, state


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

    ``planner`` turns --checkpointing auto into a plan for this device and process count (the CLI hands
    in the planner's ``plan_for``; the loop itself never imports the planner). Under torchrun every rank
    runs this function; rank 0 alone logs, writes metrics and checkpoints.
    """
    info = dist_utils.init_distributed(cfg.device, cfg.dist_timeout)
    try:
        # One process writes a run directory: rank 0 holds its lock for the whole run.
        with DirLock(cfg.run_dir, "--out-dir") if info.is_main else contextlib.nullcontext():
            if info.is_main:
                prepare_run_dir(cfg.run_dir, cfg.resume, cfg.overwrite)
            return _train(cfg, info, planner)
    finally:
        dist_utils.shutdown(info)


def _train(cfg: TrainConfig, info: dist_utils.DistInfo, planner: Planner | None) -> dict:
    device = dist_utils.local_device(info, resolve_device(cfg.device))
    dtype = autocast_dtype(cfg.precision, device)
    main = info.is_main
    if not main:
        logging.getLogger("fitgpt").setLevel(logging.WARNING)  # one log, from rank 0
    if info.enabled and cfg.parallel == "fsdp" and cfg.compile:
        raise ValueError("--compile with --parallel fsdp is not supported yet; drop --compile or use --parallel ddp")
    if main:
        ensure_prepared(cfg.data, progress=cfg.progress)
    if info.enabled:
        torch.distributed.barrier()  # the other ranks wait while rank 0 prepares the data on first use
    data = TokenData(cfg.data.path)
    meta = data.meta
    data.check_context(cfg.model.context_length)
    # The model's vocabulary comes from the data, rounded up to a multiple of 64 for fast matmuls.
    vocab_size = int(math.ceil(data.vocab_size / 64) * 64)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    run_dir = cfg.run_dir

    model = build_model(cfg, vocab_size, device)
    # Names that share one tensor (the tied head): safetensors stores one of them.
    tied = [name for names in _remove_duplicate_names(model.state_dict()).values() for name in names]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    # Each rank samples its own windows; rank 0 draws exactly what a single process would.
    train_sampler = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + info.rank)
    start_step, state = 0, None
    tok_hash = data.tokenizer_sha256
    if cfg.resume:
        path, (ck_meta, state) = ckpt.resolve_resume(run_dir, cfg.resume, lambda p: _load_for_resume(p, cfg, model, tok_hash))
        scaler.load_state_dict(state["scaler"])
        ranks = ck_meta.get("world_size", 1)
        if ranks != info.world:
            log.warning("resuming a %d-process run on %d processes: the data order differs from the original run", ranks, info.world)
        samplers, rngs = ck_meta.get("sampler_ranks", [ck_meta["sampler"]]), state.get("rng_ranks", [state["rng"]])
        if info.rank < len(samplers):
            train_sampler.load_state_dict(samplers[info.rank])
        _set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0], device)
        start_step = ck_meta["step"]
        if start_step >= cfg.max_steps:
            raise ValueError(f"--resume {path}: the checkpoint is at step {start_step} and --max-steps is {cfg.max_steps}, so "
                             "there is nothing to train; raise --max-steps to continue (nothing was changed)")
        _warn_changed_settings(ck_meta["config"], cfg)
        log.info("resumed from %s at step %d", path, start_step)
    if main:
        # resume and overwrite are what this invocation did, not settings of the run: `--config config.json` must not repeat them.
        (run_dir / "config.json").write_text(json.dumps(to_dict(dataclasses.replace(cfg, resume=None, overwrite=False)), indent=1))
        # The run keeps its own tokenizer, so sampling works even if the data directory moves.
        shutil.copyfile(cfg.data.path / "tokenizer.json", run_dir / "tokenizer.json")

    # Preparation order, the same on every rank: checkpointing, then compile, then DDP or FSDP.
    if cfg.checkpointing == "auto" and planner is None:
        raise ValueError("--checkpointing auto needs a planner: pass the planner's plan_for as train(cfg, planner=...)")
    planned = planner(cfg, device, dtype, info.world) if cfg.checkpointing == "auto" else None
    policy = parse_policy(planned["policy"]) if planned else cfg.policy
    act = None
    if main:
        x0, y0 = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + 2).next_batch(device)
        act = log_activation_memory(model, policy.spec, x0, y0, device)
    apply_checkpointing(model, policy)
    log.info("checkpointing %s", policy.describe(cfg.model.n_blocks))
    step_model = torch.compile(model) if cfg.compile else model
    step_model = dist_utils.wrap(step_model, info, cfg.parallel, device, dtype if cfg.parallel == "fsdp" else None)
    # Built after sharding: under FSDP the optimizer holds only this rank's shard of every state.
    optimizer = build_optimizer(model, cfg.optim, device)
    if state is not None:
        dist_utils.load_full_optimizer_state(optimizer, state["optimizer"])

    amp = autocast(device, dtype)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.model.context_length * info.world
    log.info(
        "training %s (%.2fM params) on %s, %s, %d tokens/step (global batch %d = %d per micro-batch x %d accumulation x %d "
        "process%s%s), steps %d -> %d, run dir %s",
        cfg.preset, model.num_params() / 1e6, device, dtype or "fp32", tokens_per_step, cfg.batch_size * cfg.grad_accum * info.world,
        cfg.batch_size, cfg.grad_accum, info.world, "es" if info.world > 1 else "", f", {cfg.parallel}" if info.enabled else "",
        start_step, cfg.max_steps, run_dir,
    )
    metrics = MetricsWriter(run_dir, cfg.tensorboard, resume_step=start_step) if main else None

    def save(step: int) -> Path | None:
        # Collectives first, on every rank: the full weights (FSDP), the optimizer state, every rank's data position.
        weights = None
        if info.enabled and cfg.parallel == "fsdp":
            weights = {k: v for k, v in dist_utils.full_model_state(model).items() if k not in tied}
        opt_state = dist_utils.full_optimizer_state(optimizer) if info.enabled else optimizer.state_dict()
        samplers = dist_utils.gather_objects(info, train_sampler.state_dict())
        rngs = dist_utils.gather_objects(info, _rng_state(device))
        path, error = None, None
        if main:
            state_out = {"optimizer": opt_state, "scaler": scaler.state_dict(), "rng": rngs[0], "rng_ranks": rngs}
            meta_out = {"config": to_dict(cfg), "sampler": samplers[0], "sampler_ranks": samplers, "world_size": info.world,
                        "data": {"dir": str(cfg.data.path), "tokenizer_sha256": tok_hash}}
            try:
                path = ckpt.save_checkpoint(run_dir, step, weights if weights is not None else model, state_out, meta_out, cfg.keep_last)
                log.info("saved %s", path)
            except ckpt.CheckpointSaveError as e:
                error = e
        if dist_utils.any_rank(info, error is not None, device):
            if metrics:
                metrics.close()
            raise TrainingError(str(error) if error else "rank 0 could not write a checkpoint (see its log)") from error
        return path

    # disable=None hides the bar when stderr is not a terminal (CI logs, pipes).
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=None if cfg.progress and main else True, dynamic_ncols=True)
    step, loss_value, val_loss, bad_steps, last_ckpt = start_step, float("nan"), None, 0, None
    t_start = time.perf_counter()
    t_log = time.perf_counter()
    model.train()
    probe_step = start_step + 1 if cfg.max_steps > start_step + 1 else start_step
    stopping = False
    with _StopFlag() as stop:
        while step < cfg.max_steps:
            lr = lr_at(step, cfg.optim, cfg.max_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # With --checkpointing auto, the second step of this process is measured against the plan.
            # (Not under torch.compile off CUDA: compiled kernels allocate outside the tracker's view.)
            measurable = not info.enabled and (device.type == "cuda" or not cfg.compile)
            probe = PeakProbe(model, optimizer) if planned and step == probe_step and measurable else None
            with probe or contextlib.nullcontext():
                total = 0.0
                try:
                    for micro in range(cfg.grad_accum):
                        x, y = train_sampler.next_batch(device)
                        # Gradients are reduced across ranks once, on the last micro-batch.
                        with dist_utils.sync_context(step_model, cfg.parallel, micro == cfg.grad_accum - 1), amp():
                            # Only the loss is kept: holding the B x T x vocab logits through backward costs memory.
                            loss = step_model(x, y)[1]
                            scaler.scale(loss / cfg.grad_accum).backward()
                        total += loss.item() / cfg.grad_accum
                        del loss
                except torch.OutOfMemoryError:
                    raise TrainingError(
                        f"out of memory at step {step} (batch {cfg.batch_size} x {cfg.model.context_length}, checkpointing "
                        f"{policy.spec!r}). Run `fitgpt plan --preset {cfg.preset} --batch-size {cfg.batch_size} --context "
                        f"{cfg.model.context_length} --memory-budget <your GPU's memory>` for a plan that fits, or train with "
                        "--checkpointing auto --memory-budget <size>; a smaller --batch-size with a larger --grad-accum "
                        "keeps the tokens per step"
                    ) from None
                total = dist_utils.all_mean(info, total, device)  # every rank decides on the same numbers
                scaler.unscale_(optimizer)
                clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                good = math.isfinite(total) and (dtype == torch.float16 or bool(torch.isfinite(grad_norm)))
                if good:
                    scaler.step(optimizer)
                    scaler.update()
                optimizer.zero_grad(set_to_none=True)
            if probe is not None:
                planned["measured_peak"] = probe.result.peak
                log.info("auto: measured peak %s (%s) vs predicted %s, budget %s", format_bytes(probe.result.peak),
                         probe.result.source, format_bytes(planned["predicted_peak"]), format_bytes(planned["budget"]))
            if not good:
                bad_steps += 1
                message = (
                    f"loss is {total} at step {step} (lr {lr:.3g}, grad norm {float(grad_norm):.3g}); "
                    f"last good checkpoint: {last_ckpt or (ckpt.list_checkpoints(run_dir) or ['none'])[-1]}"
                )
                if bad_steps > cfg.max_bad_steps:
                    if metrics:
                        metrics.close()
                    raise TrainingError(message + ". Lower --optim.lr, or allow skips with --max-bad-steps")
                log.warning("skipping bad step: %s", message)
                step += 1
                continue
            step += 1
            loss_value = total
            bar.update(1)
            if main and (step % cfg.log_interval == 0 or step == cfg.max_steps):
                now = time.perf_counter()
                tps = tokens_per_step * cfg.log_interval / max(now - t_log, 1e-9)
                t_log = now
                peak = peak_memory_bytes(device)
                metrics.write({"step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm), "tokens_per_s": tps,
                               "peak_mem": peak})
                bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}", mem=f"{peak / 2**20:.0f}MiB")
            if step % cfg.eval_interval == 0 or step == cfg.max_steps:
                val_loss = evaluate(step_model, data, cfg, device, amp)
                if main:
                    metrics.write({"step": step, "val_loss": val_loss})
                log.info("step %d: train loss %.4f, val loss %.4f", step, loss_value, val_loss)
            # A signal may reach one rank only: all of them stop, and save, at the same step.
            stopping = dist_utils.any_rank(info, stop.signal is not None, device)
            if step % cfg.ckpt_interval == 0 or step == cfg.max_steps or stopping:
                last_ckpt = save(step)
            if stopping:
                log.warning("stopped by %s at step %d; resume with --resume latest", stop.signal or "a signal on another rank", step)
                break
    bar.close()
    elapsed = time.perf_counter() - t_start
    png = None
    if main:
        metrics.close()
        png = plot_loss_curve(metrics.path, run_dir / "loss.png")
    remove_checkpointing(model)
    summary = {
        "run_dir": str(run_dir),
        "steps": step,
        "train_loss": loss_value,
        "val_loss": val_loss,
        "seconds": elapsed,
        "interrupted": stop.signal or ("SIGNAL" if stopping and step < cfg.max_steps else None),
        "checkpoint": str(last_ckpt) if last_ckpt else None,
        "loss_png": str(png) if png else None,
        "activation_bytes": act,
        "memory_plan": planned,
        "data_tokens": meta["train_tokens"],
        "world_size": info.world,
        "rank": info.rank,
    }
    return summary
