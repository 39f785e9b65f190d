"""`fitgpt train`: preset < --config file < flags, all through the TrainConfig dataclass."""

from __future__ import annotations

import dataclasses
import json
import os

import tyro
from tqdm.contrib.logging import logging_redirect_tqdm

from fitgpt.cli import command_started
from fitgpt.config import TrainConfig, load_config_named_in
from fitgpt.errors import UserError
from fitgpt.train.loop import TrainingError
from fitgpt.train.trainer import train
from fitgpt.units import format_bytes


def parse(args: list[str]) -> TrainConfig:
    # Only --preset and --config are looked at first, to pick the defaults; tyro parses every flag.
    cfg = tyro.cli(TrainConfig, default=load_config_named_in(args), args=args, prog="fitgpt train")
    steps, budget = _given("--max-steps", args), _given("--time-budget", args)
    if steps and budget and cfg.time_budget is not None:
        raise UserError("--time-budget and --max-steps each say how long to train: drop one of them")
    if steps and cfg.time_budget is not None:  # a run of a time budget (its --config) continued by steps
        cfg = dataclasses.replace(cfg, time_budget=None)
    return cfg


def _given(flag: str, args: list[str]) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _planner(cfg: TrainConfig):
    """--activation-checkpointing auto: the loop is handed the planner's entry point (it never imports the planner)."""
    if cfg.activation_checkpointing != "auto":
        return None
    from fitgpt.plan.auto import plan_for

    return plan_for


def _auto_config(cfg: TrainConfig) -> TrainConfig:
    """--auto-config: the fastest configuration that fits, chosen before the run (the loop is handed a plain config)."""
    if not cfg.auto_config:
        return cfg
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--auto-config chooses for one process: run fitgpt fit --world-size N --memory-budget ... and "
                         "launch the torchrun command it prints")
    if cfg.resume:
        raise UserError("--auto-config chooses a new run's configuration; to continue a run, resume with its config.json "
                         "(it records what was chosen): --config RUN/config.json --resume latest")
    from fitgpt.plan.fastest import for_training
    from fitgpt.train.distributed import DistInfo
    from fitgpt.train.setup import load_data

    _, cfg = load_data(cfg, DistInfo())  # prepared on first use, as training would: the model's vocabulary is the data's
    chosen, c, _ = for_training(cfg)
    print(f"auto-config: micro-batch {c.micro_batch} x accumulation {c.grad_accum}, {c.precision}, checkpointing "
          f"'{c.plan.spec()}': predicted peak {format_bytes(c.peak)} of {cfg.memory_budget}, {c.tokens_per_s:,.0f} tokens/s")
    return chosen


def run(args: list[str]) -> int:
    cfg = parse(args)
    cfg = _auto_config(cfg)
    try:
        with logging_redirect_tqdm():
            summary = train(cfg, planner=_planner(cfg), started=command_started())  # --time-budget counts from there
    except TrainingError as e:
        print(f"fitgpt train: {e}")
        return 1
    if summary["rank"] != 0:  # under torchrun, rank 0 reports for all
        return 0
    print(f"run: {summary['run_dir']}  steps: {summary['steps']}  train loss: {summary['train_loss']:.4f}  "
          f"val loss: {summary['val_loss'] if summary['val_loss'] is None else round(summary['val_loss'], 4)}  "
          f"time: {summary['seconds']:.1f}s")
    if summary["interrupted"]:
        print(f"interrupted by {summary['interrupted']}; continue with: "
              f"fitgpt train --config {summary['run_dir']}/config.json --resume latest")
    else:
        print(f"sample it: fitgpt generate --run {summary['run_dir']} --prompt 'def '")
    print(json.dumps(summary))
    return 0
