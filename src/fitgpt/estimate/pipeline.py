"""A pipeline's memory, planned per rank: each stage's rank runs the trainer's own pipeline step (its stages,
checkpointed and sharded as the trainer does them, run by the same PyTorch schedule) on fake tensors, as that rank of
a fake process group, and its peak is read as the trainer's probe reads a real one.

No composition of per-block profiles is trusted here: what a schedule holds depends on the order it runs the
micro-batches in (GPipe every forward first, 1F1B at most P - s in flight on stage s, interleaved its own table), the
receive buffers it keeps for every micro-batch, and the head on the last stage only. Running the schedule gives all of
them; fake tensors make it seconds for any size. A stage's data-parallel ranks (FSDP's) hold the same shapes, so the
first of them stands for all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitgpt.config import TrainConfig


@dataclass(frozen=True)
class StageRank:
    """One pipeline rank's plan: its stages' blocks and the bytes it holds at its step's peak."""

    rank: int
    """The rank's place in the pipeline (0: the first stage's)."""
    blocks: tuple[tuple[int, int], ...]
    """Each of its stages' blocks, (first, last)."""
    peak: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    """The receive buffers the schedule keeps for every micro-batch (activations in, their gradients back)."""

    @property
    def activations(self) -> int:
        """What the step adds over what is held across steps: activations in flight, temporaries."""
        return self.peak - self.params - self.grads - self.optimizer - self.buffers


def plan_pipeline(cfg: TrainConfig, world: int, dtype: torch.dtype | None = None, device: str = "cpu",
                  ranks: list[int] | None = None) -> list[StageRank]:
    """Each pipeline rank's plan (or those of ``ranks``) for ``cfg`` (--pipeline-parallel, its schedule, micro-batches,
    checkpointing policy and optimizer) over ``world`` processes, training in ``dtype`` (autocast's, or under FSDP the
    gathered weights'; None: fp32)."""
    ranks = list(range(cfg.pipeline_parallel)) if ranks is None else ranks
    return [_plan_rank(cfg, world, r, dtype, torch.device(device)) for r in ranks]


def _plan_rank(cfg: TrainConfig, world: int, pp_rank: int, dtype: torch.dtype | None, device: torch.device) -> StageRank:
    from fitgpt.activation_checkpoint import parse_policy
    from fitgpt.device import autocast
    from fitgpt.estimate.ranks import fake_ranks
    from fitgpt.memory.fake import fake_mode, fake_module
    from fitgpt.memory.timeline import PeakProbe, optimizer_state_bytes, param_bytes, unique_bytes
    from fitgpt.model import Transformer
    from fitgpt.optim import build_optimizer
    from fitgpt.parallel.fsdp import precision_roles
    from fitgpt.parallel.pipeline import prepare_pipeline
    from fitgpt.step import train_step

    sharded = world > cfg.pipeline_parallel
    amp_dtype, param_dtype = precision_roles(dtype, sharded)
    with fake_ranks(world, pp=cfg.pipeline_parallel, rank=pp_rank * (world // cfg.pipeline_parallel)) as mesh:
        mode = fake_mode()
        with torch.device("meta"):
            model = fake_module(Transformer(cfg.model), device, mode)
        pipe = prepare_pipeline(model, parse_policy(cfg.activation_checkpointing), cfg, mesh, device, param_dtype)
        with mode:
            optimizer = build_optimizer(pipe.held, cfg.optim, device, seed=cfg.seed)
            ids = torch.zeros(cfg.batch_size, cfg.model.context_length, dtype=torch.long, device=device)  # (B, T)
            step = dict(amp=autocast(device, amp_dtype), grad_clip=cfg.optim.grad_clip, check=False)  # fake: no values
            train_step(pipe, optimizer, [(ids, ids)], **step)  # the first step makes the state and the buffers
            with PeakProbe(pipe.held, optimizer, pipe.comm_buffers()) as probe:
                train_step(pipe, optimizer, [(ids, ids)], **step)
        blocks = tuple((s.blocks[0], s.blocks[-1]) for s in pipe.stages)
        return StageRank(rank=pp_rank, blocks=blocks, peak=probe.result.peak, params=param_bytes(pipe.held),
                         grads=probe.result.grads, optimizer=optimizer_state_bytes(optimizer),
                         buffers=unique_bytes(pipe.comm_buffers()))
