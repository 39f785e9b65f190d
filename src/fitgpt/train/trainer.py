"""Training, as a recipe: load data, resume, prepare the model (checkpointing, then compile, then DDP/FSDP),
then the loop (`fitgpt.train.loop`) of the shared ``train_step``, evaluation and saves.

``train(cfg)`` is the entry point; ``_train`` reads as the recipe, each stage a function in `setup` or here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fitgpt import float8
from fitgpt.activation_checkpoint import Policy, remove_activation_checkpointing
from fitgpt.config import TrainConfig
from fitgpt.data.loader import BatchSampler, TokenData
from fitgpt.device import autocast, autocast_dtype, resolve_device
from fitgpt.errors import UserError
from fitgpt.hf import import_config
from fitgpt.memory.allocator import expandable_from
from fitgpt.optim import build_optimizer, describe_optimizer
from fitgpt.parallel import tensor as tensor_parallel
from fitgpt.parallel.fsdp import materialise, precision_roles
from fitgpt.parallel.stages import materialise as materialise_stages
from fitgpt.refusals import float8_refusal, launch_refusal, meta_model_refusal
from fitgpt.step import grad_scaler
from fitgpt.train import distributed as dist_utils
from fitgpt.train.deadline import run_length
from fitgpt.train.dist_checkpoint import DistributedSaver, load_optimizer
from fitgpt.train.loop import LoopState, TrainingError, run_loop, tokens_per_step
from fitgpt.train.metrics import MetricsWriter, plot_loss_curve
from fitgpt.train.resume import resume_run
from fitgpt.train.rundir import claim_run_dir
from fitgpt.train.setup import (
    Planner,
    activation_bytes,
    build_model,
    choose_policy,
    init_from_hf,
    load_data,
    log_activation_memory,
    prepare_model,
    write_run_files,
)
from fitgpt.train.signals import deferred as deferred_signals
from fitgpt.utils import DirLock

log = logging.getLogger(__name__)


def train(cfg: TrainConfig, planner: Planner | None = None, started: float | None = None,
          clock: Callable[[], float] = time.perf_counter) -> dict:
    """Train per cfg and return a summary (steps, losses, time, run directory).

    ``planner`` turns --activation-checkpointing auto into a plan for this device and process count (the CLI hands
    in the planner's ``plan_for``; the loop itself never imports the planner). Under torchrun every rank
    runs this function; rank 0 alone logs, writes metrics and checkpoints. ``started`` (`time.perf_counter`'s clock):
    when the run's time began, for --time-budget (the CLI's process start; default: now). ``clock``: what a
    --time-budget's deadline reads (a test's own, whose verdict then never depends on how busy the machine is).
    """
    started = clock() if started is None else started  # a --time-budget counts from here
    info = dist_utils.init_distributed(cfg.device, cfg.dist_timeout)
    heartbeat = dist_utils.Heartbeat.start(info, on_stalled=lambda rank: _stop_stalled(info, rank, cfg.dist_stall_timeout),
                                           stalled_s=cfg.dist_stall_timeout)
    try:
        _check_launch(cfg, info)
        with contextlib.ExitStack() as held:
            def claim() -> str | None:  # one process writes a run directory: rank 0 holds its lock for the whole run
                held.enter_context(DirLock(cfg.run_dir, "--out-dir"))
                return claim_run_dir(cfg.run_dir, cfg.resume, cfg.overwrite, cfg.data.path)

            # --resume auto is decided once, by rank 0 under the lock, for every rank.
            cfg = dataclasses.replace(cfg, resume=dist_utils.from_main(info, claim))
            summary = _train(cfg, info, planner, started, clock)
            dist_utils.meet(info)
            return summary
    except Exception as e:
        if info.enabled and not isinstance(e, (TrainingError, UserError)) and dist_utils.is_lost_peer(e):
            with deferred_signals():  # torchrun SIGTERMs the survivors at once: the line comes first
                raise TrainingError(dist_utils.describe_lost(info, heartbeat, e)) from e
        raise
    finally:
        if heartbeat:
            heartbeat.stop()
        dist_utils.shutdown(info)


def _stop_stalled(info: dist_utils.DistInfo, rank: int, stalled_s: float) -> None:
    """A rank that stopped answering: no collective waiting on it will fail before --dist-timeout, and gloo's cannot
    be interrupted, so this rank says why and leaves at once (from the heartbeat's thread). Every checkpoint stays
    whole: a save cut short is a temporary directory, never listed, removed by the next save."""
    log.error("%s", dist_utils.describe_stalled(info, rank, stalled_s))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(2)


@dataclass
class _Activations:
    """One micro-batch's activation bytes, measured on rank 0: with no checkpointing before the policy is applied,
    then with the policy, as `prepare_model` applies it (once) and before it compiles or shards the model."""

    x: torch.Tensor
    y: torch.Tensor
    device: torch.device
    spec: str
    measured: dict

    def inspect(self, model: nn.Module) -> None:
        if self.spec != "none":
            self.measured[self.spec] = activation_bytes(model, self.x, self.y, self.device)
        log_activation_memory(self.measured, self.x)


def _measure_activations(model: nn.Module, policy: Policy, cfg: TrainConfig, data: TokenData, device: torch.device,
                         info: dist_utils.DistInfo) -> _Activations | None:
    if not info.is_main:
        return None
    x, y = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed + 2).next_batch(device)
    return _Activations(x, y, device, policy.spec, {"none": activation_bytes(model, x, y, device)})


def _check_launch(cfg: TrainConfig, info: dist_utils.DistInfo) -> None:
    """What can be refused before anything is written: the device, and settings this launch cannot honour (the
    refusals plan and fit consult too)."""
    device = resolve_device(cfg.device)
    if cfg.parallel == "fsdp" and not info.enabled:
        raise UserError("--parallel fsdp shards the model across processes, and this is one: launch with torchrun "
                         "--nproc-per-node N (N >= 2), or use --parallel ddp (the default) to train in one process")
    if cfg.init_from and (Path(cfg.init_from) / "config.json").is_file():  # the model trained: --init-from's
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(import_config(cfg.init_from),
                                                                 weights_dtype=cfg.model.weights_dtype))
    for why in (launch_refusal(cfg, info.world, device.type, autocast_dtype(cfg.precision, device)),
                meta_model_refusal(cfg), float8_refusal(cfg), cfg.float8 != "none" and float8.device_refusal(device)):
        if why:
            raise UserError(why)


def _train(cfg: TrainConfig, info: dist_utils.DistInfo, planner: Planner | None, started: float,
           clock: Callable[[], float]) -> dict:
    device = dist_utils.local_device(info, resolve_device(cfg.device))
    dtype = autocast_dtype(cfg.precision, device)
    if not info.is_main:
        logging.getLogger("fitgpt").setLevel(logging.WARNING)  # one log, from rank 0
    # The imported model's shape, on a restart too (torchrun --max-restarts runs the same command, now resuming); a
    # resumed run whose folder is gone keeps the model of its config.json.
    if cfg.init_from and (not cfg.resume or (Path(cfg.init_from) / "config.json").is_file()):
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(import_config(cfg.init_from),
                                                                 weights_dtype=cfg.model.weights_dtype))
    data, cfg = load_data(cfg, info)
    # Under FSDP or tensor parallelism the model is built on the meta device; once sharded, each rank fills only its
    # shards: with the initial weights, a resumed run's, or a Hugging Face model's (--init-from).
    shards = info.world if info.enabled and (cfg.parallel == "fsdp" or cfg.model_splits() > 1) else 1
    model = build_model(cfg, cfg.model.vocab_size, device, shards)
    if cfg.init_from and not cfg.resume and shards == 1:
        init_from_hf(cfg, model, info, device, sharded=False)
    scaler = grad_scaler(device, dtype)
    # Every rank draws each step's global batch alike and takes its data-parallel rank's slice (the ranks of one
    # tensor-parallel group or pipeline, the same one): any layout of the same global batch trains the same windows.
    sampler = BatchSampler(data.splits["train"], cfg.batch_size, cfg.model.context_length, seed=cfg.seed,
                           vocab_size=data.vocab_size, ranks=dist_utils.data_ranks(cfg, info),
                           rank=dist_utils.data_rank(cfg, info), grad_accum=cfg.grad_accum)
    if info.is_main and not cfg.resume:  # a fresh run's, before planning (its retry after a failed plan is not blocked)
        write_run_files(cfg)
    policy, planned = choose_policy(cfg, planner, device, info)
    whole = shards == 1  # the model each rank trains is the whole model
    act = _measure_activations(model, policy, cfg, data, device, info) if whole else None
    if shards > 1:
        log.info("activation memory: not measured before sharding (the model is never whole on a rank); "
                 "metrics.jsonl records each logged step's peak, and with --activation-checkpointing auto every rank's "
                 "measured peak is logged beside the plan's")
    step_model = prepare_model(model, policy, cfg, info, device, dtype, inspect=act and act.inspect)
    if cfg.pipeline_parallel > 1:  # this rank's stages: what it fills, steps and saves
        materialise_stages(model, step_model.stages, torch.device("cpu") if cfg.fsdp_offload else device, cfg.seed)
        if cfg.init_from and not cfg.resume:
            init_from_hf(cfg, model, info, device, sharded=True, stages=step_model.held)
        model = step_model.held
    elif shards > 1:
        materialise(model, torch.device("cpu") if cfg.fsdp_offload else device, cfg.seed)
        if cfg.init_from and not cfg.resume:
            init_from_hf(cfg, model, info, device, sharded=True)
    if cfg.tensor_parallel > 1:  # a group's ranks consecutive: its rank is the process's rank modulo tp
        tensor_parallel.seed_dropout_apart(device, cfg.seed, info.rank % cfg.tensor_parallel)
    # Weights, data positions and RNG: read into the model as it trains (under FSDP, each rank's shards).
    t_resume = time.perf_counter()
    start_step, state = resume_run(cfg, info, model, scaler, sampler, device, data) if cfg.resume else (0, None)
    # Built after sharding: under FSDP the optimizer holds only this rank's shard of every state.
    # Offloaded, the parameters live in host memory and the optimizer steps there.
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu") if cfg.fsdp_offload else device, seed=cfg.seed)
    if state is not None:
        load_optimizer(optimizer, state["optimizer"], info, getattr(model, "numbering", None))
        log.info("checkpoint read in %.2fs (weights, optimizer state, data positions, RNG)", time.perf_counter() - t_resume)
        # Only once every rank has read every part of the checkpoint: a refused resume changes nothing in the run.
        dist_utils.meet(info)
        if info.is_main:
            write_run_files(cfg)
    _log_start(cfg, info, model, device, dtype, start_step)
    metrics = MetricsWriter(cfg.run_dir, cfg.tensorboard, resume_step=start_step) if info.is_main else None
    amp_dtype, _ = precision_roles(dtype, cfg.parallel == "fsdp" and info.enabled)  # FSDP: pure half precision, no autocast
    saver = (DistributedSaver(info, cfg.run_dir, cfg.keep_last, cfg.background_saves(device.type), cfg.dist_timeout)
             if info.enabled else None)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights and two moments, about
    length = run_length(cfg, info, device, started, state["time_spent"] if state else 0.0, state_bytes, clock)
    run = LoopState(cfg, info, device, data, model, step_model, optimizer, scaler, sampler, autocast(device, amp_dtype), policy,
                    planned, metrics, saver, length)
    t_start = clock()
    try:
        with tensor_parallel.step_context(model):  # loss_parallel, over a head split on the vocabulary
            progress = run_loop(run, start_step)
    except BaseException:
        if saver:
            saver.close_after_failure()
        raise
    finally:
        if metrics:
            metrics.close()
    png = plot_loss_curve(metrics.path, cfg.run_dir / "loss.png") if metrics else None
    remove_activation_checkpointing(model)
    return {
        "run_dir": str(cfg.run_dir), "steps": progress.step, "train_loss": progress.loss, "val_loss": progress.val_loss,
        "val_loss_se": progress.val_loss_se, "seconds": clock() - t_start, "interrupted": progress.interrupted,
        "checkpoint": str(progress.checkpoint) if progress.checkpoint else None, "loss_png": str(png) if png else None,
        "activation_bytes": act and act.measured, "memory_plan": planned, "data_tokens": data.meta["train_tokens"],
        "world_size": info.world, "rank": info.rank, "time_spent": length.spent_now(),
    }


def _log_start(cfg: TrainConfig, info: dist_utils.DistInfo, model: nn.Module, device: torch.device, dtype: torch.dtype | None,
               start_step: int) -> None:
    tp = cfg.tensor_parallel
    layout = f", {cfg.parallel}" if info.enabled else ""
    if tp > 1:
        layout = f", tensor parallel over {tp}" + (f", FSDP over {info.world // tp} x {tp}" if info.world > tp else "")
    if cfg.pipeline_parallel > 1:  # the parameters are this rank's stages'
        pp, split = cfg.pipeline_parallel, cfg.model_splits()
        layout = (f", pipeline of {pp} ranks ({cfg.pipeline_schedule}, {cfg.microbatches} micro-batches)"
                  + (f", tensor parallel over {tp}" if tp > 1 else "")
                  + (f", FSDP over {info.world // split}" if info.world > split else ""))
        tp = split  # the data-parallel ranks below
    log.info(
        "training %s (%.2fM params) on %s, %s, %d tokens/step (global batch %d = %d per micro-batch x %d accumulation x %d "
        "process%s%s), %s, %s, run dir %s",
        cfg.preset, (model.num_params() if hasattr(model, "num_params") else sum(p.numel() for p in set(model.parameters())))
        / 1e6, device, dtype or "fp32", tokens_per_step(cfg, info),
        cfg.batch_size * cfg.grad_accum * info.world // tp, cfg.batch_size, cfg.grad_accum, info.world // tp,
        "es" if info.world // tp > 1 else "", layout, describe_optimizer(cfg.optim, device, model),
        f"steps {start_step} -> {cfg.max_steps}" if cfg.time_budget is None else
        f"from step {start_step} for --time-budget {cfg.time_budget} (the learning rate over the time)", cfg.run_dir,
    )
    if device.type == "cuda":  # what the plan's replay should model: plan --alloc-conf, or the same environment
        log.info("CUDA caching allocator: %s", "expandable segments (expandable_segments:True)" if expandable_from()
                 else "the default (no expandable_segments in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF)")


