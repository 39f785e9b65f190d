"""The training loop: the shared ``train_step`` on each rank's next micro-batches, results read in one host
sync at each log, evaluation or save point, bad steps skipped or stopped at, and checkpoints written (under
torchrun, every rank its shards, in the background by default)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
from tqdm.auto import tqdm

from fitgpt.activation_checkpoint import Policy
from fitgpt.config import TrainConfig, to_dict
from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.device import is_host_oom, peak_memory
from fitgpt.memory.snapshot import MeasuredSnapshot, write_snapshot
from fitgpt.memory.timeline import PeakProbe
from fitgpt.optim import set_lr
from fitgpt.parallel.data import sync_context
from fitgpt.step import StepResult, train_step
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as dist_utils
from fitgpt.train.deadline import Deadline, StepBudget
from fitgpt.train.dist_checkpoint import DistributedSaver
from fitgpt.train.metrics import MetricsWriter
from fitgpt.train.resume import rng_state
from fitgpt.train.signals import StopFlag
from fitgpt.units import format_bytes

log = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training stopped for a reason the user can act on (divergence, out of memory)."""


@torch.no_grad()
def evaluate(model: nn.Module, data: TokenData, cfg: TrainConfig, device: torch.device, amp) -> tuple[float, float]:
    """Mean val loss over cfg.eval_batches fixed batches (the same windows at every evaluation), and its standard
    error over them (how well those windows stand for the validation split: a scaling law's point's noise)."""
    was_training = model.training
    model.eval()
    sampler = BatchSampler(data.splits["val"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + 1,
                           vocab_size=data.vocab_size)
    losses = []
    for _ in range(cfg.eval_batches):
        x, y = sampler.next_batch(device)
        with amp():
            _, loss = model(x, y)
        losses.append(loss.item())
    model.train(was_training)
    se = float(np.std(losses, ddof=1) / np.sqrt(len(losses))) if len(losses) > 1 else float("nan")
    return float(np.mean(losses)), se


@dataclass
class LoopState:
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
    saver: DistributedSaver | None
    """Under torchrun, what writes every rank's shards of a checkpoint; one process writes its own."""
    length: StepBudget | Deadline
    """How long the run is: its steps, or its time (`fitgpt.train.deadline`)."""


@dataclass
class Progress:
    step: int
    loss: float = float("nan")
    grad_norm: float = float("nan")
    val_loss: float | None = None
    val_loss_se: float | None = None
    """The standard error of val_loss over its evaluation's batches."""
    bad_steps: int = 0
    checkpoint: Path | None = None
    interrupted: str | None = None
    applied: bool = True
    """Whether the newest step read was applied (not skipped as non-finite)."""


def tokens_per_step(cfg: TrainConfig, info: dist_utils.DistInfo) -> int:
    return cfg.batch_size * cfg.grad_accum * cfg.model.context_length * dist_utils.data_ranks(cfg, info)


def run_loop(run: LoopState, start_step: int) -> Progress:
    """Step, log, evaluate, save, until --max-steps, the --time-budget's deadline, or a signal.

    The steps' results stay on the device; they are read together (one host sync) at each log,
    evaluation or save point, where skipped (non-finite) steps are reported, or stop the run."""
    cfg, info = run.cfg, run.info
    p = Progress(step=start_step)
    # disable=None hides the bar when stderr is not a terminal (CI logs, pipes).
    timed = isinstance(run.length, Deadline)
    bar = tqdm(total=None if timed else cfg.max_steps, initial=start_step, disable=None if cfg.progress and info.is_main else True,
               dynamic_ncols=True)
    t_log = time.perf_counter()
    run.model.train()
    # With --activation-checkpointing auto, the second step of this process is measured against the plan.
    probe_step = start_step + 1 if timed or cfg.max_steps > start_step + 1 else start_step
    pending: list[tuple[int, float, StepResult]] = []  # (step, lr, result) not read on the host yet
    recording = MeasuredSnapshot(run.model, run.optimizer, run.device).__enter__() if cfg.memory_snapshot else None
    with StopFlag() as stop, contextlib.ExitStack() as cleanup:
        cleanup.callback(lambda: recording and recording.__exit__(None, None, None))  # a run stopped while recording
        last = False
        while not last:
            lr = run.length.lr(p.step, cfg)
            set_lr(run.optimizer, lr)
            pending.append((p.step, lr, _run_step(run, recording, p.step, probe=run.planned is not None and p.step == probe_step)))
            p.step += 1
            last = run.length.last(p.step)
            if recording is not None:  # a recorded step ends as the plan's: its results read, and freed, before the next
                with recording.outside():
                    _read_results(run, p, pending)
                pending = []
                recording = _recorded(run, recording, p.step - start_step)
            # What happens between steps (logging, evaluation, saves) is no part of a recorded step.
            with recording.outside() if recording is not None else contextlib.nullcontext():
                bar.update(1)
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
                    t_eval = run.length.clock()
                    p.val_loss, p.val_loss_se = evaluate(run.step_model, run.data, cfg, run.device, run.amp)
                    run.length.timed("eval", run.length.clock() - t_eval)
                    if run.metrics:
                        run.metrics.write({"step": p.step, "val_loss": p.val_loss, "val_loss_se": p.val_loss_se})
                    log.info("step %d: train loss %.4f, val loss %.4f", p.step, p.loss, p.val_loss)
                if save_due or stopping:
                    t_save = run.length.clock()
                    p.checkpoint = _save(run, p.step, deadline_reached=timed and last) or p.checkpoint
                    run.length.timed("save", run.length.clock() - t_save)
            if stopping:
                p.interrupted = stop.signal or ("SIGNAL" if not last else None)
                log.warning("stopped by %s at step %d; resume with --resume latest", stop.signal or "a signal on another rank", p.step)
                break
        finish_saves(run, p)
    bar.close()
    return p


def _run_step(run: LoopState, recording: MeasuredSnapshot | None, step: int, probe: bool) -> StepResult:
    """This rank's next micro-batches, trained on; a recording counts them as the plan's step counts its own (they are
    freed as the step returns, before its results)."""
    def draw() -> list:
        return [run.sampler.next_batch(run.device) for _ in range(run.cfg.grad_accum)]

    return _step(run, recording.batch(draw) if recording is not None else draw(), step, probe)


def _recorded(run: LoopState, recording: MeasuredSnapshot, steps: int) -> MeasuredSnapshot | None:
    """After ``steps`` recorded steps: the next one numbered, or once --memory-snapshot steps are, the snapshot written."""
    if steps < run.cfg.memory_snapshot and steps < run.cfg.max_steps:
        recording.next_step()
        return recording
    recording.__exit__(None, None, None)
    name = f"memory_snapshot_rank_{run.info.rank}.pickle" if run.info.enabled else "memory_snapshot.pickle"
    path = write_snapshot(recording.snapshot, run.cfg.run_dir / name)
    how = "the CUDA allocator's history" if run.device.type == "cuda" else "the live-tensor tracker" + (
        ", which does not see inside compiled code (--compile)" if run.cfg.compile else "")
    log.info("memory snapshot of %d step%s (%s): %s; open it at https://pytorch.org/memory_viz, or compare it with the "
             "plan: fitgpt plan ... --compare %s", steps, "s" if steps > 1 else "", how, path, path)
    return None


def _read_results(run: LoopState, p: Progress, pending: list[tuple[int, float, StepResult]]) -> bool:
    """Read the pending steps' results in one host sync: the newest applied loss and gradient norm go to
    ``p``, each skipped step is reported (or stops the run). Returns whether the newest step was applied (with
    none pending: the newest read before)."""
    if not pending:
        return p.applied
    values = torch.stack([torch.stack([r.loss.float(), r.grad_norm.float(), r.applied.float()]) for _, _, r in pending]).tolist()
    for (step, lr, _), (loss, grad_norm, applied) in zip(pending, values):
        if applied:
            p.loss, p.grad_norm = loss, grad_norm
        else:
            _skip_bad_step(run, p, step, loss, grad_norm, lr)
    p.applied = bool(values[-1][2])
    return p.applied


def _step(run: LoopState, batches: list, step: int, probe: bool) -> StepResult:
    """One shared ``train_step`` on this rank's micro-batches; with ``probe``, its peak is checked against the plan."""
    cfg, info = run.cfg, run.info
    # Not under torch.compile off CUDA: compiled kernels allocate outside the tracker's view.
    measurable = run.device.type == "cuda" or not cfg.compile
    # A pipeline's receive buffers are held from its first step on, as the weights are.
    held = run.step_model.comm_buffers() if hasattr(run.step_model, "comm_buffers") else ()
    peak = PeakProbe(run.model, run.optimizer, held) if probe and measurable else None
    try:
        with peak or contextlib.nullcontext():
            result = train_step(
                run.step_model, run.optimizer, batches, amp=run.amp, scaler=run.scaler, grad_clip=cfg.optim.grad_clip,
                # Gradients are reduced across ranks once, on the last micro-batch; every rank decides on the same loss.
                sync=lambda last: sync_context(run.step_model, last),
                reduce=lambda loss: dist_utils.all_mean_tensor(info, loss),
            )
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not isinstance(e, torch.OutOfMemoryError) and not is_host_oom(e):
            raise
        raise TrainingError(
            f"out of memory at step {step} (batch {cfg.batch_size} x {cfg.model.context_length}, checkpointing "
            f"{run.policy.spec!r}). Run `fitgpt plan --preset {cfg.preset} --batch-size {cfg.batch_size} --context "
            f"{cfg.model.context_length} --memory-budget <your device's memory>` for a plan that fits, or train with "
            "--activation-checkpointing auto --memory-budget <size>; a smaller --batch-size with a larger --grad-accum "
            "keeps the tokens per step"
        ) from None
    if peak is not None:
        _log_measured_peak(run, peak.result)
    return result


def _log_measured_peak(run: LoopState, measured) -> None:
    """Every rank's measured peak (rank 0 logs them all) beside the plan's prediction for one rank."""
    peaks = dist_utils.gather_objects(run.info, measured.peak)
    run.planned["measured_peak"] = max(peaks)
    if run.info.enabled:
        run.planned["measured_peaks"] = peaks
    ranks = ", ".join(f"rank {r}: {format_bytes(b)}" for r, b in enumerate(peaks)) if run.info.enabled else format_bytes(peaks[0])
    log.info("auto: measured peak %s (%s) vs predicted %s, budget %s", ranks, measured.source,
             format_bytes(run.planned["predicted_peak"]), format_bytes(run.planned["budget"]))


def _skip_bad_step(run: LoopState, p: Progress, step: int, loss: float, grad_norm: float, lr: float) -> None:
    """Step ``step`` had a non-finite loss or gradient and was not applied: warn, or stop after --max-bad-steps."""
    p.bad_steps += 1
    last = p.checkpoint or (ckpt.list_checkpoints(run.cfg.run_dir) or ["none"])[-1]
    message = f"loss is {loss} at step {step} (lr {lr:.3g}, grad norm {grad_norm:.3g}); last good checkpoint: {last}"
    if p.bad_steps > run.cfg.max_bad_steps:
        if run.cfg.optim.steps_in_backward:  # applied during the backward: the weights in memory took it, none is saved
            raise TrainingError(message + ". Lower --optim.lr (with --optim.in-backward a bad step is applied before it "
                                "is known, so the run stops and the checkpoints stay as they were)")
        raise TrainingError(message + ". Lower --optim.lr, or allow skips with --max-bad-steps")
    log.warning("skipping bad step: %s", message)


def _log_metrics(run: LoopState, p: Progress, lr: float, bar: tqdm, t_log: float) -> float:
    """Write a metrics line and update the bar; returns the time of this log, for the next throughput."""
    now = time.perf_counter()
    tps = tokens_per_step(run.cfg, run.info) * run.cfg.log_interval / max(now - t_log, 1e-9)
    key, peak = peak_memory(run.device)
    run.metrics.write({"step": p.step, "loss": p.loss, "lr": lr, "grad_norm": p.grad_norm, "tokens_per_s": tps, key: peak})
    bar.set_postfix(loss=f"{p.loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tps:.0f}", mem=f"{peak / 2**20:.0f}MiB")
    return now


def _save(run: LoopState, step: int, deadline_reached: bool = False) -> Path | None:
    """Write checkpoint ``step``; returns the newest checkpoint known to be written (a background save's is known
    at the next). Every rank's RNG is gathered first (a collective every rank joins). One process
    writes its own; under torchrun every rank writes its shards (`dist_checkpoint`). A failed write stops every rank."""
    cfg, info = run.cfg, run.info
    rngs = dist_utils.gather_objects(info, rng_state(run.device))
    state = {"scaler": run.scaler.state_dict(), "rng": rngs[0], "rng_ranks": rngs}
    # The data's position: the same on every rank (each draws every global batch).
    meta = {"config": to_dict(cfg), "sampler": run.sampler.state_dict(), "world_size": info.world,
            "data": {"dir": str(cfg.data.path), "tokenizer_sha256": run.data.tokenizer_sha256},
            "time_spent": run.length.spent_now(), "deadline_reached": deadline_reached}
    try:
        if run.saver is not None:
            return run.saver.save(step, run.model, run.optimizer, state, meta)
        path = ckpt.save_checkpoint(cfg.run_dir, step, run.model, {**state, "optimizer": run.optimizer.state_dict()}, meta,
                                    cfg.keep_last)
    except ckpt.CheckpointSaveError as e:
        raise TrainingError(e.strerror or str(e)) from e
    log.info("saved %s", path)
    return path


def finish_saves(run: LoopState, p: Progress) -> None:
    """The save still being written in the background, finished before the run ends (or stops on a signal)."""
    if run.saver is None:
        return
    try:
        p.checkpoint = run.saver.close() or p.checkpoint
    except ckpt.CheckpointSaveError as e:
        raise TrainingError(e.strerror or str(e)) from e
