"""Pipeline parallelism over fitgpt's Transformer, with PyTorch's own schedules (`torch.distributed.pipelining`):
this rank's stages (`fitgpt.parallel.stages`) run by a schedule, each micro-batch's activations sent from stage to
stage, its gradients back. The head runs inside the schedule's loss function (the last stage hands it the normed
hidden states), so that the head and loss stay one call, as a chunked or fused loss needs them.

A batch is cut into ``microbatches`` equal micro-batches; each one's loss is its mean and the gradients are divided by
their count (``scale_grads``), so that the step's gradient is the whole batch's mean, as one process's. Every stage is
given the shapes it receives and sends (PyTorch's static mode): no rank infers them from a first micro-batch, and
each receive buffer is one the planner counts (`fitgpt.estimate.pipeline`).

With data-parallel ranks besides (a mesh of ("pp", "dp")), FSDP shards each stage over its "dp" ranks, each of which
takes its own slice of the global batch, as the trainer's FSDP does. A head tied to the token embedding (GPT-2's) lives twice, on the first
stage and on the last: the two start equal and, their gradients summed after each step (as Megatron ties them), step
alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fitgpt.config import STAGES_PER_RANK, V_SCHEDULES, TrainConfig
from fitgpt.parallel.stages import Stage, held_by, pp_group, rank_stages, stage_blocks, stage_indices, stage_policy

__all__ = ["Pipeline", "build_pipeline", "launch_refusal", "pipeline_refusal", "prepare_pipeline", "schedule_stages",
           "stage_blocks", "training_mesh"]


ZERO_BUBBLE = ("interleaved-zero-bubble", "zbv", "dualpipev")
"""PyTorch's zero-bubble schedules: each backward split into the input's gradient and the weights'."""


def pipeline_refusal(n_blocks: int, pp: int, schedule: str, microbatches: int, batch_size: int) -> str | None:
    """Why the model cannot be cut so (one line naming the flag to change); None: it can."""
    stages = pp * STAGES_PER_RANK[schedule]
    if stages > n_blocks:
        return (f"--pipeline-parallel {pp} with --pipeline-schedule {schedule} cuts the model into {stages} stages, "
                f"more than its {n_blocks} blocks: use fewer stages or more blocks (--model.n-blocks)")
    if batch_size % microbatches:
        return (f"--pipeline-microbatches {microbatches} does not divide --batch-size {batch_size}: use a divisor "
                "of it, or another --batch-size")
    # PyTorch's own conditions, asked before any rank starts (its schedules raise them mid-launch).
    if schedule == "1f1b" and microbatches < pp:
        return (f"--pipeline-schedule 1f1b keeps each of its {pp} stages busy with a micro-batch of its own: use "
                f"--pipeline-microbatches {pp} or more (a divisor of --batch-size {batch_size})")
    if schedule == "dualpipev" and microbatches < stages:
        return (f"--pipeline-schedule dualpipev runs a micro-batch through each of its {stages} stages at once: use "
                f"--pipeline-microbatches {stages} or more (a divisor of --batch-size {batch_size})")
    rounds = max(1, microbatches // pp)
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble") and microbatches % rounds:
        return (f"--pipeline-schedule {schedule} runs the micro-batches in rounds of {pp}: use a multiple of {pp} "
                f"for --pipeline-microbatches (it is {microbatches})")
    return None


def launch_refusal(cfg: TrainConfig, world: int) -> str | None:
    """Why ``cfg`` cannot train with --pipeline-parallel over ``world`` processes (one line naming what to change);
    None: it can. The processes are a mesh of P stages' ranks x N data-parallel ranks (FSDP's) x T tensor-parallel
    ranks (--tensor-parallel), world = P x N x T."""
    pp, tp, optim = cfg.pipeline_parallel, cfg.tensor_parallel, cfg.optim
    split, name = pp * tp, f"--pipeline-parallel {pp}" + (f" x --tensor-parallel {tp}" if tp > 1 else "")
    if world < 2 or world % split:
        return (f"{name} over {world} process{'es' if world > 1 else ''}: launch a multiple of {split} with torchrun "
                f"(torchrun --nproc-per-node {split} -m fitgpt train ...; plan's --world-size)")
    if world > split and cfg.parallel != "fsdp":
        return (f"{name} over {world} ranks makes {world // split} data-parallel ranks a stage, which FSDP shards: add "
                f"--parallel fsdp (or use {split} ranks)")
    if world == split and cfg.parallel == "fsdp":
        return (f"--parallel fsdp with {name} over {split} ranks shards each stage over one rank, which shards nothing: "
                f"drop --parallel fsdp, or use N x {split} ranks")
    if cfg.grad_accum > 1:
        return (f"--pipeline-parallel cuts each step's batch into micro-batches itself: use --grad-accum 1 and "
                f"--pipeline-microbatches {cfg.grad_accum * cfg.microbatches} for as many")
    if optim.in_backward:
        return ("--optim.in-backward steps a parameter as its gradient completes, but a pipeline's schedule adds each "
                "micro-batch's gradient in turn, the last long after the first: drop --optim.in-backward")
    if cfg.compile and cfg.pipeline_schedule in ZERO_BUBBLE:
        return (f"--pipeline-schedule {cfg.pipeline_schedule} splits each backward in two, which PyTorch 2.13 cannot do "
                "through compiled code: drop --compile, or use --pipeline-schedule 1f1b or interleaved-1f1b")
    if cfg.pipeline_schedule in ZERO_BUBBLE and cfg.parallel == "fsdp" and cfg.reshards_after_forward:
        # PyTorch 2.13's split backward lists the stage's parameters as it starts, before FSDP's hook gathers a
        # resharded block again: the weights' pass then finds none of that block's (no gradient, or part of one).
        return (f"--pipeline-schedule {cfg.pipeline_schedule} with --parallel fsdp needs each block's weights kept "
                "gathered from its forward to its backward (PyTorch 2.13's split backward misses a resharded block's "
                "weight gradients): add --fsdp-reshard-after-forward torchtitan (or never)")
    if cfg.pipeline_schedule in V_SCHEDULES and cfg.model.tied:
        return (f"--pipeline-schedule {cfg.pipeline_schedule} puts the first and the last stage on one process, which "
                "would hold the tied embedding and head twice: use --model.tie-embeddings False, or another "
                "--pipeline-schedule")
    if tp > 1:
        from fitgpt.parallel.tensor import launch_refusal as split_refusal

        if why := split_refusal(dataclasses.replace(cfg, parallel="fsdp" if world > split else "ddp"), tp * (world // split)):
            return why
    return pipeline_refusal(cfg.model.n_blocks, pp, cfg.pipeline_schedule, cfg.microbatches, cfg.batch_size)


class LossTotal:
    """The micro-batches' losses of a step added up as they come (a running sum, not a list joined at the end: what
    it holds is one number however many micro-batches there are)."""

    def __init__(self, microbatches: int) -> None:
        self.microbatches, self.total = microbatches, None

    def add(self, loss: torch.Tensor) -> None:
        loss = loss.detach()
        self.total = loss.clone() if self.total is None else self.total + loss  # clone: each step of the sum alike

    def mean(self) -> torch.Tensor | None:
        """The step's mean loss (None where this rank computes none), and the total started anew."""
        total, self.total = self.total, None
        return None if total is None else total / self.microbatches


class Pipeline:
    """This rank's stages run by a schedule over the pipeline's ranks: a step's forward and backward (``train_batch``)
    and a forward (called as a model is, for evaluation); ``held``: this rank's parts, what is saved and stepped."""

    def __init__(self, stages: list[Stage], held: Stage, schedule, group: dist.ProcessGroup,
                 tie: dist.ProcessGroup | None, wrapped: list, losses: LossTotal, last_rank: int) -> None:
        self.stages, self.held, self.schedule, self.group, self.tie = stages, held, schedule, group, tie
        self.losses = losses  # the micro-batches' losses added up as the loss function makes them
        self.wrapped = wrapped  # PyTorch's PipelineStage of each
        self.last_rank = last_rank  # the process holding the last stage (the loss)
        self.evaluator = schedule  # what runs a forward alone (`forward_only`, where the schedule cannot)

    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch (x, y: (B, T)) through every micro-batch; the batch's mean loss, on
        every rank of the pipeline."""
        # No outputs returned: the last stage would keep every micro-batch's (b, T, C) to the step's end and join them.
        self.schedule.step(*self._inputs(x), target=y if self.held.last else None, return_outputs=False)
        if self.tie is not None:
            self._sum_tied()
        return self._shared(self.losses.mean())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        """(None, the batch's mean loss), forward only, on every rank of the pipeline."""
        self.evaluator.eval(*self._inputs(x), target=y if self.held.last else None)
        return None, self._shared(self.losses.mean())

    def comm_buffers(self) -> list[torch.Tensor]:
        """The receive buffers the schedule made for every micro-batch at its first step and keeps from then on, as
        weights are kept: each micro-batch's hidden states from the stage before, and their gradients from the one
        after."""
        held = []
        for stage in self.wrapped:
            for table in (getattr(stage, "args_recv_info", {}), getattr(stage, "grad_recv_info", {})):
                held += [info.buffer for infos in table.values() for info in infos
                         if isinstance(getattr(info, "buffer", None), torch.Tensor)]
        return held

    def _inputs(self, x: torch.Tensor) -> tuple:
        return (x,) if self.held.first else ()

    def _shared(self, mean: torch.Tensor | None) -> torch.Tensor:
        loss = mean if self.held.last else torch.zeros((), device=self.held_device)
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss

    @property
    def held_device(self) -> torch.device:
        return next(self.held.parameters()).device

    def parameters(self):
        return self.held.parameters()

    def train(self, mode: bool = True) -> Pipeline:
        self.held.train(mode)
        return self

    def eval(self) -> Pipeline:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.held.training

    def clip_grad_norm_(self, max_norm: float, foreach: bool | None) -> torch.Tensor:
        """``clip_grad_norm_`` over the whole model across the pipeline's ranks: each rank's gradients' norm (a tied
        weight's on the first stage only), their squares summed over the ranks, each gradient clipped by it."""
        params = [p for p in self.held.parameters() if p.grad is not None]
        counted = [p for p in params if not (self.tie is not None and self.held.last and p is self.held.lm_head.weight
                                             and not self.held.first)]
        norm = torch.nn.utils.get_total_norm([p.grad for p in counted], foreach=foreach)
        if hasattr(norm, "full_tensor"):  # FSDP within the stage: over its shards
            norm = norm.full_tensor()
        squares = norm.pow(2)
        dist.all_reduce(squares, group=self.group)
        norm = squares.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=foreach)
        return norm

    def _sum_tied(self) -> None:
        """The embedding's gradient (first stage) and the head's (last stage), each the tied weight's share, summed
        on both: the whole model's gradient of the one weight."""
        weight = self.held.token_embed.weight if self.held.first else self.held.lm_head.weight
        if hasattr(weight.grad, "placements") and weight.grad.placements != weight.placements:
            # Split on the vocabulary, the embedding's gradient alone comes back replicated (one process adds the
            # head's, sharded, into it): laid out as the weight, both stages' pieces then match.
            weight.grad = weight.grad.redistribute(weight.device_mesh, weight.placements)
        grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
        dist.all_reduce(grad, group=self.tie)


def schedule_stages(stages: list[Stage], held: Stage, schedule: str, microbatches: int, mesh, device: torch.device,
                    batch: tuple[int, int], dtype: torch.dtype = torch.float32) -> Pipeline:
    """``stages`` (this rank's, ready: materialised, maybe sharded) run by ``schedule`` in ``microbatches`` of this
    rank's ``batch`` (B, T), the hidden states passed between stages in ``dtype``."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as pt

    group = pp_group(mesh)
    pp = dist.get_world_size(group)
    n_stages = pp * len(stages)
    rows, context = batch[0] // microbatches, batch[1]
    tp = mesh["tp"].size() if "tp" in (mesh.mesh_dim_names or ()) else 1
    # (b, T / tp, C): under tensor parallelism a rank's sequence shard; needing a gradient: a stage's input gradient is
    # sent back, its output's received.
    hidden = torch.empty(rows, context // tp, held.config.n_embed, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.empty(rows, context, dtype=torch.long, device="meta")  # (b, T)
    wrapped = [PipelineStage(s, s.index, n_stages, device, input_args=ids if s.first else hidden,
                             output_args=hidden, group=group) for s in stages]

    last = next((s for s in stages if s.last), None)
    losses = LossTotal(microbatches)

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The running stage's head: a loss policy (chunked, fused) replaces it there, the parameters the same.
        loss = last.lm_head(hidden, targets)[1]  # the micro-batch's mean cross-entropy
        # Split on the vocabulary, loss_parallel's loss is whole on every rank: made local, as the split model's is.
        loss = loss.to_local().clone() if hasattr(loss, "to_local") else loss
        losses.add(loss)
        return loss

    classes = {"gpipe": pt.ScheduleGPipe, "1f1b": pt.Schedule1F1B, "interleaved-1f1b": pt.ScheduleInterleaved1F1B,
               "interleaved-zero-bubble": pt.ScheduleInterleavedZeroBubble, "zbv": pt.ScheduleZBVZeroBubble,
               "dualpipev": pt.ScheduleDualPipeV}
    runner = classes[schedule](wrapped if len(stages) > 1 else wrapped[0], n_microbatches=microbatches, loss_fn=loss_fn)
    last_rank = next(r for r in range(pp) if n_stages - 1 in stage_indices(schedule, pp, r))  # the loss's
    tie = _tie_group(mesh) if held.config.tied else None
    pipe = Pipeline(stages, held, runner, group, tie, wrapped, losses, dist.get_global_rank(group, last_rank))
    if schedule in V_SCHEDULES:  # ZBV's forwards evaluate either V (DualPipeV fuses its forwards with backwards)
        pipe.evaluator = forward_only(pt.ScheduleZBVZeroBubble(wrapped, n_microbatches=microbatches, loss_fn=loss_fn))
    return pipe


def forward_only(runner):
    """``runner`` (a schedule PyTorch runs from a list of actions, as ZBV) keeping only its forwards, their sends and
    receives, and FSDP's gathers: in PyTorch 2.13 such a schedule's ``eval`` still runs its backward actions, and under
    ZBV a stage's gradient handed to the stage beside it on the same rank fails ("can't steal_bwd_input if this stage
    doesn't have backward")."""
    from torch.distributed.pipelining.schedules import _ComputationType as kind

    kept = (kind.FORWARD, kind.SEND_F, kind.RECV_F, kind.UNSHARD, kind.RESHARD)
    runner.pipeline_order_with_comms = {r: [a for a in acts if a.computation_type in kept]
                                        for r, acts in runner.pipeline_order_with_comms.items()}
    return runner


def build_pipeline(model: nn.Module, schedule: str, microbatches: int, mesh, device: torch.device,
                   batch: tuple[int, int], shard: Callable[[nn.Module, object], None] | None = None) -> Pipeline:
    """``model`` (built whole) split over the "tp" ranks of ``mesh`` where it has them, cut into this rank's stages of
    ``schedule`` over its "pp" ranks (a DeviceMesh of ("pp", ["dp",] ["tp"])); with "dp" ranks, each stage given to
    ``shard(stage, dp_mesh)`` (FSDP's)."""
    if "tp" in mesh.mesh_dim_names:
        from fitgpt.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    stages = rank_stages(model, schedule, mesh)
    if shard is not None:
        for s in stages:
            shard(s, mesh["dp"])
    return schedule_stages(stages, held_by(stages, model), schedule, microbatches, mesh, device, batch)


def prepare_pipeline(model: nn.Module, policy, cfg: TrainConfig, mesh, device: torch.device,
                     param_dtype: torch.dtype | None, layout) -> Pipeline:
    """The trainer's pipeline (and the planner's, on fake ranks): ``model`` (on the meta device) cut into this rank's
    stages of ``mesh``, each checkpointed by ``policy``, then sharded by FSDP (parameters gathered in ``param_dtype``)
    over its data-parallel ranks, then run by ``cfg``'s schedule. Its ``held`` parts are what is filled, stepped and
    saved, numbered for the optimizer's checkpoint as the whole model's (``layout``: how the optimizer numbers and
    groups a model's parameters, `fitgpt.optim.StateLayout`)."""
    from fitgpt.activation_checkpoint import apply_activation_checkpointing
    from fitgpt.parallel.fsdp import compile_blocks, fsdp_shard
    from fitgpt.parallel.stages import Numbering

    names = mesh.mesh_dim_names or ()
    if "tp" in names:  # split first, as torchtitan orders them: the whole model's blocks, then cut into stages
        from fitgpt.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, mesh["tp"])
    stages = rank_stages(model, cfg.pipeline_schedule, mesh)
    held = held_by(stages, model)
    held.numbering = Numbering(model, held, layout)
    for stage in stages:
        apply_activation_checkpointing(stage, stage_policy(policy, stage))
        if cfg.compile:  # each block, inside its checkpoint wrapper and before FSDP's hooks, as the trainer compiles
            compile_blocks(stage)
    sharded = "dp" in names
    for stage in stages if sharded else ():
        fsdp_shard(stage, param_dtype, cfg.fsdp_offload, mesh=mesh["dp"], reshard_after_forward=cfg.reshards_after_forward)
    # The hidden states in the dtype the blocks compute in: FSDP's gathered weights', else the weights' own (autocast
    # keeps the residual stream in fp32 weights' fp32; pure bf16 weights make it bf16).
    weights = torch.bfloat16 if cfg.model.weights_dtype == "bf16" else torch.float32
    dtype = param_dtype if sharded and param_dtype is not None else weights
    return schedule_stages(stages, held, cfg.pipeline_schedule, cfg.microbatches, mesh, device,
                           (cfg.batch_size, cfg.model.context_length), dtype)


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


def training_mesh(device_type: str, world: int, pp: int, tp: int = 1):
    """The processes as a mesh of ("pp", "dp", "tp"), as torchtitan lays them out: P stages' ranks, outermost (the
    stages may sit on different nodes: only activations cross between them), by world / (P x T) data-parallel ranks
    (FSDP's), by T tensor-parallel ranks, innermost and consecutive (one node's, on its fastest link); a dimension of
    one rank left out."""
    from torch.distributed.device_mesh import init_device_mesh

    dims = [("pp", pp), ("dp", world // (pp * tp)), ("tp", tp)]
    dims = [(n, k) for n, k in dims if k > 1 or n == "pp"]
    mesh = init_device_mesh(device_type, tuple(k for _, k in dims), mesh_dim_names=tuple(n for n, _ in dims))
    if "dp" in mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names and hasattr(mesh, "_flatten"):
        mesh["dp", "tp"]._flatten("dp_tp")  # a stage's ranks as one group: the gradients' norm in one all-reduce
    return mesh


