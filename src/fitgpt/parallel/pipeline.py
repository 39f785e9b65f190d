"""Pipeline parallelism over fitgpt's Transformer, with PyTorch's own schedules (`torch.distributed.pipelining`):
the blocks cut into stages, the embedding on the first, the final norm, the head and the loss on the last; each
micro-batch's activations sent from stage to stage, its gradients back.

A stage is the model with only its own parts: the blocks of other stages are placeholders without parameters, so
every parameter keeps the name it has in the whole model (a checkpoint's names, and the block indices a checkpointing
policy names). The head runs inside the schedule's loss function (the stage hands it the normed hidden states), so
that the head and loss stay one call, as a chunked or fused loss needs them.

Each rank holds one stage (GPipe, 1F1B) or, interleaved, ``STAGES_PER_RANK`` of them, looped: rank r holds stages
r, r + P, ... A batch is cut into ``microbatches`` equal micro-batches; each one's loss is its mean and the gradients
are divided by their count (``scale_grads``), so that the step's gradient is the whole batch's mean, as one process's.

With data-parallel ranks besides (a mesh of ("pp", "dp")), FSDP shards each stage over its "dp" ranks, each of which
draws its own rows, as the trainer's FSDP does. A head tied to the token embedding (GPT-2's) lives twice, on the first
stage and on the last: the two start equal and, their gradients summed after each step (as Megatron ties them), step
alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2}


def stage_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Each stage's blocks, in order: as even as they divide, the first stages one more where they do not (the last
    stage's head and loss weigh as a block or more)."""
    per, extra = divmod(n_blocks, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + per + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def pipeline_refusal(n_blocks: int, pp: int, schedule: str, microbatches: int, batch_size: int) -> str | None:
    """Why the model cannot be cut so (one line naming the flag to change); None: it can."""
    stages = pp * STAGES_PER_RANK[schedule]
    if stages > n_blocks:
        return (f"--pipeline-parallel {pp} with --pipeline-schedule {schedule} cuts the model into {stages} stages, "
                f"more than its {n_blocks} blocks: use fewer stages or more blocks (--model.n-blocks)")
    if batch_size % microbatches:
        return (f"--pipeline-microbatches {microbatches} does not divide --batch-size {batch_size}: use a divisor "
                "of it, or another --batch-size")
    return None


class Stage(nn.Module):
    """The parts of ``model`` that stage ``index`` of ``n_stages`` runs, under their names in ``model``."""

    def __init__(self, model: nn.Module, index: int, n_stages: int) -> None:
        super().__init__()
        self.config = model.config
        self.blocks = stage_blocks(len(model.attn_blocks), n_stages)[index]
        self.first, self.last = index == 0, index == n_stages - 1
        if self.first:
            self.token_embed, self.position_embed = model.token_embed, model.position_embed
            self.embed_dropout = model.embed_dropout
        self.attn_blocks = nn.ModuleList([b if i in self.blocks else nn.Identity() for i, b in enumerate(model.attn_blocks)])
        if self.last:
            self.layer_norm, self.lm_head = model.layer_norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, else the hidden states (B, T, C); returns the hidden states (B, T, C),
        normed on the last stage (the head is the loss function's)."""
        if self.first:
            from fitgpt.model.transformer import Transformer

            x = Transformer._pre_attn_pass(self, x)  # (B, T, C): the whole model's, over this stage's parts
        for i in self.blocks:
            x = self.attn_blocks[i](x)
        return self.layer_norm(x) if self.last else x


@dataclass
class Pipeline:
    """This rank's stages and the schedule that runs them (``step``), over the ``group`` of pipeline ranks; ``tie``:
    the group of the first and last stages' ranks, where the head is tied to the embedding."""

    stages: list[Stage]
    schedule: object
    tie: dist.ProcessGroup | None = None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of the batch (x, y: (B, T)) through every micro-batch; the batch's mean loss on the
        rank that holds the last stage, None elsewhere."""
        losses: list[torch.Tensor] = []
        last = any(s.last for s in self.stages)
        self.schedule.step(x if any(s.first for s in self.stages) else None, target=y if last else None, losses=losses)
        if self.tie is not None:
            self._sum_tied()
        return torch.stack(losses).mean() if last else None

    def _sum_tied(self) -> None:
        """The embedding's gradient (first stage) and the head's (last stage), each the tied weight's share, summed
        on both: the whole model's gradient of the one weight."""
        for s in self.stages:
            weight = s.token_embed.weight if s.first else s.lm_head.weight if s.last else None
            if weight is not None:
                grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
                dist.all_reduce(grad, group=self.tie)


def build_pipeline(model: nn.Module, schedule: str, microbatches: int, mesh, device: torch.device,
                   shard: Callable[[nn.Module, object], None] | None = None) -> Pipeline:
    """``model`` cut into this rank's stages of ``schedule`` over the "pp" ranks of ``mesh`` (a DeviceMesh of ("pp",)
    or ("pp", "dp")); with "dp" ranks, each stage given to ``shard(stage, dp_mesh)`` (FSDP's) before it runs."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    group = mesh["pp"].get_group() if mesh.mesh_dim_names and "dp" in mesh.mesh_dim_names else mesh.get_group()
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = STAGES_PER_RANK[schedule]
    n_stages = pp * per_rank
    stages = [Stage(model, rank + k * pp, n_stages) for k in range(per_rank)]
    if shard is not None:
        for s in stages:
            shard(s, mesh["dp"])
    wrapped = [PipelineStage(s, rank + k * pp, n_stages, device, group=group) for k, s in enumerate(stages)]
    head = next((s for s in stages if s.last), None)

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return head.lm_head(hidden, targets)[1]  # the micro-batch's mean cross-entropy

    if per_rank > 1:
        runner = ScheduleInterleaved1F1B(wrapped, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = cls(wrapped[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return Pipeline(stages, runner, _tie_group(mesh) if model.config.tied else None)


def _tie_group(mesh) -> dist.ProcessGroup | None:
    """The group of this rank's first-stage and last-stage ranks (the same data-parallel index): made by every rank
    for every pair, as ``new_group`` asks."""
    ranks = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # (pp, dp) global ranks
    mine = None
    for d in range(ranks.shape[1]):
        group = dist.new_group([int(ranks[0, d]), int(ranks[-1, d])])
        if dist.get_rank() in (int(ranks[0, d]), int(ranks[-1, d])):
            mine = group
    return mine
