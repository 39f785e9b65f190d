"""The one-line refusals the trainer and the planning commands share: what cannot run, said the same way by
``fitgpt train`` as by the ``plan`` and ``fit`` that would plan it. `launch_refusal` is the one list all three
consult, before any work, for a run's settings over a number of processes on a device."""

from __future__ import annotations

import torch
import torch.nn as nn

from fitgpt.config import OptimConfig, TrainConfig

IN_BACKWARD_ONE_PROCESS = ("--optim.in-backward steps each parameter during the backward, before DDP or FSDP could "
                           "reduce its gradient across processes: train in one process (no torchrun, --world-size 1)")

OFFLOAD_ONE_PROCESS = ("--optim.offload is one card's optimizer on its host; several processes shard theirs with "
                       "--parallel fsdp --fsdp-offload: drop --optim.offload (or train in one process, --world-size 1)")


def fsdp_optimizer_refusal(optim: OptimConfig) -> str:
    """Why FSDP cannot take an optimizer other than AdamW (low-bit AdamW's quantized moments have no sharded form,
    Adafactor's factors and Muon's whole-matrix step do not follow FSDP's row shards); the refusal names what to change."""
    if optim.name == "muon":
        return ("--optim.name muon under FSDP: Muon orthogonalises each whole matrix, which FSDP holds in row shards, "
                "and PyTorch's Muon takes no sharded one: use --parallel ddp, or --optim.name adamw under FSDP")
    if optim.name == "adafactor":
        return ("--optim.name adafactor under FSDP: its factored moments (a row and a column of a matrix) do not follow "
                "FSDP's row shards, and fitgpt has not proven its sharded step or checkpoints exact: use --parallel ddp, "
                "or --optim.name adamw with --optim.state-dtype bf16 under FSDP")
    if optim.projects:
        return (f"--optim.name {optim.name} under FSDP: it projects each whole matrix's gradient (GaLore by its SVD, "
                "APOLLO by a random matrix), which FSDP holds in row shards, and its library takes no sharded one: use "
                "--parallel ddp, or --optim.name adamw under FSDP")
    return (f"--optim.name {optim.name} quantizes its moments in a form FSDP cannot shard or gather, so no checkpoint "
            "could be saved: use --parallel ddp, or --optim.name adamw with --optim.state-dtype bf16 (2-byte moments) "
            "under FSDP")


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


BF16_WEIGHTS_ONE_PROCESS = ("--model.weights-dtype bf16 rounds each update into the weights in one process; under "
                            "torchrun use fp32 weights (FSDP's pure bf16: --parallel fsdp --precision bf16), or train in "
                            "one process (--world-size 1)")


def launch_refusal(cfg: TrainConfig, world: int, device_type: str, dtype: torch.dtype | None,
                   planned: bool = False) -> str | None:
    """Why ``cfg`` cannot train over ``world`` processes on ``device_type`` computing in ``dtype`` (autocast's, as
    --precision resolves there), or be ``planned`` there on fake tensors; one line naming what to change; None: it can.
    The trainer refuses a launch with it, ``plan`` a plan, ``fit`` a layout it would search."""
    optim = cfg.optim
    if world > 1 and cfg.parallel == "fsdp" and optim.name != "adamw":
        return fsdp_optimizer_refusal(optim)
    if optim.in_backward and world > 1:
        return IN_BACKWARD_ONE_PROCESS
    if cfg.tensor_parallel > 1:
        from fitgpt.tensor_parallel import launch_refusal as split_refusal

        if why := split_refusal(cfg, world):
            return why
    if cfg.model.weights_dtype == "bf16" and world > 1:
        return BF16_WEIGHTS_ONE_PROCESS
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


def meta_model_refusal(cfg: TrainConfig) -> str | None:
    """`model_refusal` for fitgpt's model of ``cfg``, built on the meta device (no memory, a fraction of a second)."""
    if not (cfg.optim.projects and cfg.optim.rank):
        return None
    from fitgpt.model import Transformer

    with torch.device("meta"):
        return model_refusal(cfg.optim, Transformer(cfg.model))
