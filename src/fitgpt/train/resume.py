"""Continuing a run from a checkpoint: the same model, the same tokenizer, every rank's data position and RNG,
and a warning for each setting whose change makes the run differ from the uninterrupted one."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
import torch.nn as nn

from fitgpt.config import OptimConfig, TrainConfig, to_dict
from fitgpt.data.loader import GLOBAL_BATCH, BatchSampler, TokenData
from fitgpt.errors import UserError
from fitgpt.model import ModelConfig
from fitgpt.optim import optimizer_params
from fitgpt.train import checkpoint as ckpt
from fitgpt.train import distributed as dist_utils
from fitgpt.units import format_duration, parse_duration

log = logging.getLogger(__name__)


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def resume_run(cfg: TrainConfig, info: dist_utils.DistInfo, model: nn.Module, scaler: torch.amp.GradScaler,
            sampler: BatchSampler, device: torch.device, data: TokenData) -> tuple[int, dict]:
    """Load weights, scaler, this rank's data position and RNG from --resume; returns (step, state)."""
    path, (ck_meta, state) = ckpt.resolve_resume(
        cfg.run_dir, cfg.resume, lambda p: load_for_resume(p, cfg, model, data.tokenizer_sha256))
    scaler.load_state_dict(state["scaler"])
    _resume_data(ck_meta, sampler, info)
    rngs = state.get("rng_ranks", [state["rng"]])
    set_rng_state(rngs[info.rank] if info.rank < len(rngs) else rngs[0], device)
    step = ck_meta["step"]
    _check_left_to_train(path, step, ck_meta, cfg)
    state["time_spent"] = _time_spent(path, ck_meta)  # of a --time-budget (a run of steps: none)
    warn_changed_settings(ck_meta["config"], cfg)
    log.info("resumed from %s at step %d", path, step)
    return step, state


def _resume_data(ck_meta: dict, sampler: BatchSampler, info: dist_utils.DistInfo) -> None:
    """The data's position from the checkpoint: every rank draws each global batch, so any layout continues the same
    stream where the global batch is the same. A checkpoint of the per-rank sampler (each data-parallel rank its own
    stream) continues from its first rank's position, drawing global batches from there; said once."""
    state = ck_meta["sampler"]
    try:
        sampler.load_state_dict(state)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"--resume: the checkpoint's data position (meta.json's sampler) cannot be read ({e}); resume "
                        "from another checkpoint") from None
    if not info.is_main:
        return
    if state.get("kind") != GLOBAL_BATCH:
        log.warning("this checkpoint's data position is the per-rank sampler's (an earlier fitgpt: each data-parallel "
                    "rank drew its own windows); the run continues from its first rank's position, every layout now "
                    "drawing the same global batches (one process of one micro-batch a step: the windows it would have "
                    "drawn)")
    elif state.get("global_batch") != sampler.global_batch:
        was, per_accum = state.get("global_batch"), sampler.batch_size * sampler.ranks
        keep = f": --grad-accum {was // per_accum} keeps it" if isinstance(was, int) and was % per_accum == 0 else ""
        log.warning("the global batch changed (%s windows a step then, %d now%s): the stream continues from the same "
                    "position, cut into steps of %d", was, sampler.global_batch, keep, sampler.global_batch)


def _check_left_to_train(path: Path, step: int, ck_meta: dict, cfg: TrainConfig) -> None:
    """A resume with nothing left to train is refused, naming the setting to raise (nothing was changed)."""
    if cfg.time_budget is None:  # a run of steps (a run of a time budget continued by steps too): its steps decide
        if step >= cfg.max_steps:
            raise UserError(f"--resume {path}: the checkpoint is at step {step} and --max-steps is {cfg.max_steps}, so "
                            "there is nothing to train; raise --max-steps to continue (nothing was changed)")
        return
    spent, budget = _time_spent(path, ck_meta), ck_meta["config"].get("time_budget")
    ended = ck_meta.get("deadline_reached") and budget and cfg.budget_seconds <= parse_duration(budget)
    if spent >= cfg.budget_seconds or ended:
        raise UserError(f"--resume {path}: the run has spent {format_duration(spent)} of --time-budget "
                        f"{cfg.time_budget}, so there is nothing to train; raise --time-budget to continue (nothing was "
                        "changed)")


def _time_spent(path: Path, ck_meta: dict) -> float:
    """The seconds of its --time-budget a checkpoint's run had spent (0 for a run of steps, or one written before)."""
    spent = ck_meta.get("time_spent") or 0.0
    if isinstance(spent, bool) or not isinstance(spent, (int, float)) or not 0 <= spent < float("inf"):
        raise UserError(f"--resume {path}: its meta.json's time_spent is {spent!r}, not a number of seconds; resume "
                        "from another checkpoint (--resume DIR)")
    return float(spent)


def load_for_resume(path: Path, cfg: TrainConfig, model: nn.Module, tok_hash: str) -> tuple[dict, dict]:
    """Meta and state of checkpoint ``path``, its weights loaded into ``model``; CheckpointError if it is corrupt."""
    ck_meta = ckpt.verify_checkpoint(path)
    # The data first: its tokenizer sets the model's vocabulary, so another one is named as such, not as a shape.
    if ck_meta.get("data", {}).get("tokenizer_sha256") not in (None, tok_hash):
        raise UserError(f"--resume {path}: the data in {cfg.data.path} was tokenized with another tokenizer than the "
                        f"checkpoint was trained with; resume on its own data (--data.dir {_trained_on(ck_meta)})")
    check_same_model(path, ck_meta["config"]["model"], cfg)
    check_same_optimizer(path, ck_meta["config"], cfg)
    ckpt.load_weights(path, model, ck_meta)  # a tensor at a time; under FSDP each rank keeps its shard
    state = ckpt.load_state(path, ck_meta, [p.shape for p in optimizer_params(model)])
    return ck_meta, state


def _trained_on(meta: dict) -> str:
    data = meta.get("config", {}).get("data", {})
    return str(data.get("dir") or "as in the run's config.json")


def check_same_model(path: Path, saved: dict, cfg: TrainConfig) -> None:
    """The checkpoint's model must be the one this run builds: every ModelConfig setting but dropout (a change of
    trajectory, warned about below) is compared, a key older checkpoints lack as its default."""
    for f in dataclasses.fields(ModelConfig):
        had, now = saved.get(f.name, f.default), getattr(cfg.model, f.name)
        if f.name == "vocab_size" and had != now and not cfg.init_from:  # set from the data's tokenizer, not a flag
            raise UserError(f"--resume {path}: the checkpoint's vocabulary has {had} ids, the data in {cfg.data.path} "
                            f"gives {now}: it was tokenized with another tokenizer; resume on the data the run trained "
                            "on (--data.dir as in its config.json)")
        if f.name != "dropout" and had != now:
            raise UserError(
                f"--resume {path}: the checkpoint has model.{f.name}={had!r}, this run asks for {now!r}; resume with "
                f"the run's own config (--config {cfg.run_dir / 'config.json'}) or set --model.{f.name.replace('_', '-')} {had}"
            )


# What a resume may change, decided here alone. The optimizer's state is kept in the form its settings give it: AdamW's
# two moments (fp32, bf16, or torchao's 8-bit and 4-bit, all saved as plain moments) read into one another; any other
# optimizer, GaLore's and APOLLO's projections and Kahan's compensation are their own. Every other setting may change:
# the run then differs from the uninterrupted one (warned), and steps with the settings it logs.
_ADAMW_MOMENTS = ("adamw", "adamw8bit", "adamw4bit")
_STATE_FORM = ("optim.name", "optim.rank", "optim.update_proj_gap", "optim.proj_scale")
_TRAJECTORY = ("batch_size", "grad_accum", "max_steps", "time_budget", "seed", "precision", "model.dropout", "data.dir") + tuple(
    f"optim.{f.name}" for f in dataclasses.fields(OptimConfig))


def _setting(d: dict, key: str, default=None):
    for part in key.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return default if d is None else d


def check_same_optimizer(path: Path, saved: dict, cfg: TrainConfig) -> None:
    """A checkpoint's optimizer state is read only by an optimizer that keeps it in the same form; otherwise a one-line
    refusal naming both settings and what to do, before anything is read or written."""
    defaults, now = to_dict(TrainConfig()), to_dict(cfg)
    was = {k: _setting(saved, k, _setting(defaults, k)) for k in _STATE_FORM + ("optim.rounding",)}
    ask = {k: _setting(now, k) for k in was}
    if was["optim.name"] in _ADAMW_MOMENTS and ask["optim.name"] in _ADAMW_MOMENTS:
        differ = []
    else:
        differ = [k for k in _STATE_FORM if was[k] != ask[k]]
    if "kahan" in (was["optim.rounding"], ask["optim.rounding"]) and was["optim.rounding"] != ask["optim.rounding"]:
        differ.append("optim.rounding")
    if differ:
        flags = ", ".join(f"--{k.replace('_', '-')} {was[k]} (this run asks for {ask[k]})" for k in differ)
        raise UserError(f"--resume {path}: the checkpoint's optimizer state was made with {flags}, a form the other "
                        f"setting cannot read; resume with the checkpoint's settings (--config {cfg.run_dir / 'config.json'}), "
                        "or start a new run from its weights (fitgpt export, then --init-from) in another --out-dir")


def warn_changed_settings(saved: dict, cfg: TrainConfig) -> None:
    now = to_dict(cfg)
    changed = [f"{key} {a} -> {_setting(now, key)}" for key in _TRAJECTORY
               if (a := _setting(saved, key)) is not None and a != _setting(now, key)]
    if changed:
        log.warning("resuming with changed settings (%s): the run is no longer bitwise the uninterrupted one; it steps "
                    "with the settings it logs", ", ".join(changed))
