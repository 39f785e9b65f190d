"""`fitgpt train`: preset < --config file < flags, all through the TrainConfig dataclass."""

from __future__ import annotations

import argparse
import json

import tyro
from tqdm.contrib.logging import logging_redirect_tqdm

from fitgpt.config import TrainConfig
from fitgpt.train import TrainingError, load_config, train


def parse(args: list[str]) -> TrainConfig:
    # Only --preset and --config are looked at first, to pick the defaults; tyro parses every flag.
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="tiny")
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(args)
    base = load_config(known.preset, known.config)
    return tyro.cli(TrainConfig, default=base, args=args, prog="fitgpt train")


def _planner(cfg: TrainConfig):
    """--activation-checkpointing auto: the loop is handed the planner's entry point (it never imports the planner)."""
    if cfg.activation_checkpointing != "auto":
        return None
    from fitgpt.plan import plan_for

    return plan_for


def run(args: list[str]) -> int:
    cfg = parse(args)
    try:
        with logging_redirect_tqdm():
            summary = train(cfg, planner=_planner(cfg))
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
