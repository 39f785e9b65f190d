"""The shell command that trains a config: `fitgpt train` flags that give it back, under torchrun for more than one
process, on as many machines as a node's GPUs need."""

from __future__ import annotations

import shlex
import typing

from fitgpt.config import TrainConfig, load_config, to_dict


def train_flags(cfg: TrainConfig, always: tuple[str, ...] = ()) -> list[str]:
    """The `fitgpt train` arguments that give ``cfg``: its --preset and --config, then a flag for each setting that
    differs from what those two give (tyro's spellings: ``--model.n-embed 64``, ``--compile`` / ``--no-compile`` for
    a plain bool, values for an optional one), and for each key in ``always`` (``model.n_embed`` spelling) even if it
    does not differ. Parsing them gives ``cfg`` back (tested): a printed command trains the model and step that were
    planned."""
    flags = ["--preset", cfg.preset] + (["--config", cfg.config] if cfg.config else [])

    def walk(cls: type, base: dict, now: dict, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for key, value in now.items():
            if (key in ("preset", "config") and not prefix) or (base.get(key) == value and prefix + key not in always):
                continue
            name = f"--{prefix}{key.replace('_', '-')}"
            if isinstance(value, dict):
                walk(hints[key], base.get(key) or {}, value, f"{prefix}{key}.")
            elif hints[key] is bool:
                flags.append(name if value else f"--{prefix}no-{key.replace('_', '-')}")
            else:
                flags.extend([name, *(str(v) for v in (value if isinstance(value, (list, tuple)) else [value]))])

    walk(TrainConfig, to_dict(load_config(cfg.preset, cfg.config)), to_dict(cfg), "")
    return flags


GPUS_PER_NODE = 8
"""Ranks on one machine when a plan's ranks fill more than one (a node of 8 GPUs, as clouds rent them)."""


def ranks_per_node(world_size: int) -> int:
    """How many of ``world_size`` ranks one machine runs: all of them up to a node's GPUs, else a full node each."""
    return world_size if world_size <= GPUS_PER_NODE or world_size % GPUS_PER_NODE else GPUS_PER_NODE


def train_command(cfg: TrainConfig, world_size: int = 1) -> str:
    """The shell command that trains ``cfg`` (under torchrun for more than one process, on as many machines as a node's
    GPUs need: the same command on each, meeting at the first's address), quoted to paste; it names its activation
    checkpointing even where that is the preset's (the planned choice). ``--resume auto`` makes a restart continue."""
    per_node = ranks_per_node(world_size)
    if world_size == 1:
        launch = ["fitgpt", "train"]
    elif per_node == world_size:
        launch = ["torchrun", "--nproc-per-node", str(world_size), "-m", "fitgpt", "train"]
    else:
        launch = ["torchrun", "--nnodes", str(world_size // per_node), "--nproc-per-node", str(per_node), "--rdzv-backend",
                  "c10d", "--rdzv-endpoint", "FIRST_NODE:29400", "--rdzv-id", "fitgpt", "-m", "fitgpt", "train"]
    flags = train_flags(cfg, always=("activation_checkpointing",))
    if per_node != world_size and not cfg.resume:
        flags += ["--resume", "auto"]
    return shlex.join(launch + flags).replace("FIRST_NODE", "$FIRST_NODE")
