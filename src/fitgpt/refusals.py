"""The one-line refusals the trainer and the planning commands share: what cannot run, said the same way by
``fitgpt train`` as by the ``plan`` and ``fit`` that would plan it. `launch_refusal` is the one list all three
consult, before any work, for a run's settings over a number of processes on a device."""

from __future__ import annotations

import torch
import torch.nn as nn

from fitgpt.config import OptimConfig, TrainConfig

IN_BACKWARD_DDP = ("--optim.in-backward steps each parameter from its gradient's accumulation hook, which under DDP fires "
                   "before that gradient's bucket is all-reduced: each rank would step on its own gradient, and the "
                   "replicas part. Add --parallel fsdp (FSDP runs the hook once the shard is reduced), or train in one "
                   "process")


OFFLOAD_ONE_PROCESS = ("--optim.offload is one card's optimizer on its host; several processes shard theirs with "
                       "--parallel fsdp --fsdp-offload: drop --optim.offload (or train in one process, --world-size 1)")


def galore8bit_refusal(device_type: str | None) -> str | None:
    """Why galore-adamw8bit cannot train on ``device_type`` (None: planning it) or be planned; None: it can train."""
    if device_type == "cuda":
        return None
    why = ("bitsandbytes' 8-bit kernels run on CUDA only" if device_type else
           "its 8-bit moments are made by bitsandbytes' CUDA kernels, which the planner's fake tensors cannot run, so "
           "its state cannot be measured")
    return (f"--optim.name galore-adamw8bit: {why}: use --optim.name galore-adamw or galore-adafactor (planned to the "
            "byte), or train it on a CUDA card")


def offload_refusal(device_type: str) -> str | None:
    """Why --optim.offload cannot run on ``device_type`` (None: it can)."""
    if device_type == "cuda":
        return None
    return (f"--optim.offload moves the optimizer from a CUDA card to its host; this runs on {device_type}, which holds "
            "it already: drop --optim.offload (plan for a card with --gpu NAME)")


def launch_refusal(cfg: TrainConfig, world: int, device_type: str, dtype: torch.dtype | None,
                   planned: bool = False) -> str | None:
    """Why ``cfg`` cannot train over ``world`` processes on ``device_type`` computing in ``dtype`` (autocast's, as
    --precision resolves there), or be ``planned`` there on fake tensors; one line naming what to change; None: it can.
    The trainer refuses a launch with it, ``plan`` a plan, ``fit`` a layout it would search."""
    optim = cfg.optim
    if cfg.pipeline_parallel > 1:
        from fitgpt.parallel.pipeline import launch_refusal as pipeline_launch_refusal

        if why := pipeline_launch_refusal(cfg, world):
            return why
    if cfg.fsdp_offload and world > 1 and (optim.name != "adamw" or cfg.model.weights_dtype == "bf16"):
        return (f"--fsdp-offload keeps each shard in host memory, where the whole-matrix step of "
                f"{'pure bf16 weights' if optim.name == 'adamw' else '--optim.name ' + optim.name} (each matrix "
                "gathered to one rank over the cards' collectives) cannot reach it: use --optim.name adamw with "
                "--fsdp-offload, or drop --fsdp-offload")
    if optim.in_backward and world > 1 and cfg.parallel != "fsdp" and cfg.tensor_parallel == 1:
        return IN_BACKWARD_DDP
    if cfg.tensor_parallel > 1 and cfg.pipeline_parallel == 1:  # with a pipeline: the pipeline's refusals ask
        from fitgpt.parallel.tensor import launch_refusal as split_refusal

        if why := split_refusal(cfg, world):
            return why
    if dtype == torch.float16 and (optim.in_backward or optim.offload):
        flag = "--optim.in-backward" if optim.in_backward else "--optim.offload"
        return (f"{flag} steps out of reach of fp16's loss scaler, and --precision {cfg.precision} is fp16 on this "
                "device: use --precision fp32")
    if optim.name == "galore-adamw8bit" and (why := galore8bit_refusal(None if planned else device_type)):
        return why
    if optim.offload:
        return OFFLOAD_ONE_PROCESS if world > 1 else offload_refusal(device_type)
    return None


def model_refusal(optim: OptimConfig, model: nn.Module) -> str | None:
    """Why ``optim``'s settings mean nothing for ``model`` (one line naming the flag); None: they apply. A projection
    rank above every hidden matrix's shorter side projects none of them: the run would train as another rank."""
    if not (optim.projects and optim.rank):
        return None
    from fitgpt.optim.lowrank import rank_limit
    from fitgpt.optim.muon import hidden_matrices

    limit = rank_limit(hidden_matrices(model))
    if optim.rank <= limit:
        return None
    return (f"--optim.rank {optim.rank}: the matrices {optim.name} projects in this model are at most {limit} on their "
            f"shorter side, so no projection can have that rank: use --optim.rank {limit} or less (0: the method's own, "
            "capped at the model's)")


def float8_refusal(cfg: TrainConfig, own_model: bool = True) -> str | None:
    """Why --float8 cannot train ``cfg``'s model (torchao missing, or, of fitgpt's ``own_model``, no linear it
    converts); one line naming the flag."""
    if cfg.float8 == "none":
        return None
    from fitgpt import float8
    from fitgpt.model import Transformer

    if (why := float8.missing()) or not own_model:
        return why
    with torch.device("meta"):
        return float8.unconvertible(Transformer(cfg.model))


def meta_model_refusal(cfg: TrainConfig) -> str | None:
    """`model_refusal` for fitgpt's model of ``cfg``, built on the meta device (no memory, a fraction of a second)."""
    if not (cfg.optim.projects and cfg.optim.rank):
        return None
    from fitgpt.model import Transformer

    with torch.device("meta"):
        return model_refusal(cfg.optim, Transformer(cfg.model))
