"""The one-line refusals the trainer and the planning commands share: what cannot run, said the same way by
``fitgpt train`` as by the ``plan`` and ``fit`` that would plan it."""

from __future__ import annotations

from fitgpt.config import OptimConfig

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
