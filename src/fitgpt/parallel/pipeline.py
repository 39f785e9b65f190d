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

import torch
import torch.distributed as dist
import torch.nn as nn

from fitgpt.config import STAGES_PER_RANK, TrainConfig


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


def launch_refusal(cfg: TrainConfig, world: int) -> str | None:
    """Why ``cfg`` cannot train with --pipeline-parallel over ``world`` processes (one line naming what to change);
    None: it can. The processes are a mesh of P stages' ranks x world / P data-parallel ranks (FSDP's)."""
    pp, optim = cfg.pipeline_parallel, cfg.optim
    if world < 2 or world % pp:
        return (f"--pipeline-parallel {pp} over {world} process{'es' if world > 1 else ''}: launch a multiple of {pp} "
                f"with torchrun (torchrun --nproc-per-node {pp} -m fitgpt train ...)")
    if world > pp and cfg.parallel != "fsdp":
        return (f"--pipeline-parallel {pp} over {world} ranks makes {world // pp} data-parallel ranks a stage, which "
                f"FSDP shards: add --parallel fsdp (or use {pp} ranks)")
    if world == pp and cfg.parallel == "fsdp":
        return (f"--parallel fsdp with --pipeline-parallel {pp} over {pp} ranks shards each stage over one rank, which "
                f"shards nothing: drop --parallel fsdp, or use N x {pp} ranks")
    if cfg.grad_accum > 1:
        return (f"--pipeline-parallel cuts each step's batch into micro-batches itself: use --grad-accum 1 and "
                f"--pipeline-microbatches {cfg.grad_accum * cfg.microbatches} for as many")
    if optim.in_backward:
        return ("--optim.in-backward steps a parameter as its gradient completes, but a pipeline's schedule adds each "
                "micro-batch's gradient in turn, the last long after the first: drop --optim.in-backward")
    for flag, on in (("--optim.offload", optim.offload), ("--fsdp-offload", cfg.fsdp_offload), ("--compile", cfg.compile),
                     ("--tensor-parallel", cfg.tensor_parallel > 1), ("--init-from", bool(cfg.init_from)),
                     ("--activation-checkpointing auto", cfg.activation_checkpointing == "auto")):
        if on:
            return (f"--pipeline-parallel with {flag} is not built yet (issue 58: the pipeline trains with FSDP, "
                    f"any named checkpointing policy and AdamW): drop {flag.split()[0]}")
    if optim.name != "adamw" or cfg.model.weights_dtype == "bf16":
        what = "--model.weights-dtype bf16" if optim.name == "adamw" else f"--optim.name {optim.name}"
        return (f"--pipeline-parallel steps AdamW (fp32 or bf16 moments) for now; {what} over a pipeline's stages is "
                f"not built yet (issue 58): use --optim.name adamw with fp32 weights")
    return pipeline_refusal(cfg.model.n_blocks, pp, cfg.pipeline_schedule, cfg.microbatches, cfg.batch_size)


class Stage(nn.Module):
    """The parts of ``model`` that a stage runs (``blocks``, and the embedding if ``first``, the final norm and the head
    if ``last``), under their names in ``model``. Also what a rank holds of all its stages, to save and step."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.config, self.blocks, self.first, self.last = model.config, blocks, first, last
        if first:
            self.token_embed, self.position_embed = model.token_embed, model.position_embed
            self.embed_dropout = model.embed_dropout
        self.attn_blocks = nn.ModuleList([b if i in blocks else nn.Identity() for i, b in enumerate(model.attn_blocks)])
        if last:
            self.layer_norm, self.lm_head = model.layer_norm, model.lm_head

    @classmethod
    def of(cls, model: nn.Module, index: int, n_stages: int) -> Stage:
        """Stage ``index`` of ``n_stages``."""
        return cls(model, list(stage_blocks(len(model.attn_blocks), n_stages)[index]), index == 0, index == n_stages - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, else the hidden states (B, T, C); returns the hidden states (B, T, C),
        normed on the last stage (the head is the loss function's)."""
        if self.first:
            from fitgpt.model.transformer import Transformer

            x = Transformer._pre_attn_pass(self, x)  # (B, T, C): the whole model's, over this stage's parts
        for i in self.blocks:
            x = self.attn_blocks[i](x)
        return self.layer_norm(x) if self.last else x


def held_by(stages: list[Stage], model: nn.Module) -> Stage:
    """What a rank holds of ``model`` over its ``stages``, as one module (its parameters under their whole names)."""
    blocks = sorted(i for s in stages for i in s.blocks)
    return Stage(model, blocks, any(s.first for s in stages), any(s.last for s in stages))


def rank_stages(model: nn.Module, schedule: str, mesh) -> list[Stage]:
    """This rank's stages of ``schedule`` over the "pp" ranks of ``mesh``: rank r of P holds r, r + P, ..."""
    group = pp_group(mesh)
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = STAGES_PER_RANK[schedule]
    return [Stage.of(model, rank + k * pp, pp * per_rank) for k in range(per_rank)]


def stage_policy(policy, stage: Stage):
    """``policy`` (an activation-checkpointing Policy) as ``stage`` takes it: a loss term (chunked, fused) only on the
    last stage, which holds the head."""
    import dataclasses

    return policy if stage.last else dataclasses.replace(policy, loss_chunk_rows=None, loss_fused_rows=None)


def pp_group(mesh) -> dist.ProcessGroup:
    return mesh["pp"].get_group() if mesh.mesh_dim_names and "dp" in mesh.mesh_dim_names else mesh.get_group()


@torch.no_grad()
def materialise(model: nn.Module, stages: list[Stage], device: torch.device, seed: int) -> None:
    """``model`` built on the meta device, ``stages`` this rank's (maybe sharded): their parameters allocated on
    ``device`` and filled with the weights one process draws from ``seed``, each parameter drawn whole in the
    model's order (the others' too, to keep the draws in step) and this rank's piece kept."""
    from fitgpt.model.transformer import fill_whole, init_std
    from fitgpt.parallel.placement import assign_whole

    held = {m for s in stages for m in s.modules()}
    places: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in held:
        for name, p in module._parameters.items():
            if p is not None:
                places.setdefault(id(p), []).append((module, name))
    # One process draws a tied weight once, as the embedding's; sharding one stage's copy made the two apart here.
    tied = model.config.tied
    order = [(n, p) for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")]
    head = [(model.lm_head, "weight")] if tied and model.lm_head in held else []
    for stage in stages:  # each its own FSDP root, where sharded: its to_empty keeps FSDP's hold on the new shards
        stage.to_empty(device=device)
    torch.manual_seed(seed)
    for name, p in order:
        whole = torch.empty(p.shape, dtype=p.dtype)
        fill_whole(whole, init_std(name, p, model.config.n_blocks))
        for module, attr in places.get(id(p), []) + (head if name == "token_embed.weight" else []):
            assign_whole(getattr(module, attr), whole.to(device))


class Pipeline:
    """This rank's stages run by a schedule over the pipeline's ranks: a step's forward and backward (``train_batch``)
    and a forward (called as a model is, for evaluation); ``held``: this rank's parts, what is saved and stepped."""

    def __init__(self, stages: list[Stage], held: Stage, schedule, group: dist.ProcessGroup,
                 tie: dist.ProcessGroup | None) -> None:
        self.stages, self.held, self.schedule, self.group, self.tie = stages, held, schedule, group, tie
        self.last_rank = dist.get_global_rank(group, dist.get_world_size(group) - 1)  # the last stage's, looped

    def train_batch(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of the batch (x, y: (B, T)) through every micro-batch; the batch's mean loss, on
        every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        self.schedule.step(*self._inputs(x), target=y if self.held.last else None, losses=losses)
        if self.tie is not None:
            self._sum_tied()
        return self._shared(losses)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, torch.Tensor]:
        """(None, the batch's mean loss), forward only, on every rank of the pipeline."""
        losses: list[torch.Tensor] = []
        self.schedule.eval(*self._inputs(x), target=y if self.held.last else None, losses=losses)
        return None, self._shared(losses)

    def _inputs(self, x: torch.Tensor) -> tuple:
        return (x,) if self.held.first else ()

    def _shared(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack(losses).mean().detach() if self.held.last else torch.zeros((), device=self.held_device)
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
        grad = weight.grad.to_local() if hasattr(weight.grad, "to_local") else weight.grad
        dist.all_reduce(grad, group=self.tie)


def schedule_stages(stages: list[Stage], held: Stage, schedule: str, microbatches: int, mesh,
                    device: torch.device) -> Pipeline:
    """``stages`` (this rank's, ready: materialised, maybe sharded) run by ``schedule`` in ``microbatches``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    group = pp_group(mesh)
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    n_stages = pp * len(stages)
    wrapped = [PipelineStage(s, rank + k * pp, n_stages, device, group=group) for k, s in enumerate(stages)]

    last = next((s for s in stages if s.last), None)

    def loss_fn(hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The running stage's head: a loss policy (chunked, fused) replaces it there, the parameters the same.
        return last.lm_head(hidden, targets)[1]  # the micro-batch's mean cross-entropy

    if len(stages) > 1:
        runner = ScheduleInterleaved1F1B(wrapped, n_microbatches=microbatches, loss_fn=loss_fn)
    else:
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        runner = cls(wrapped[0], n_microbatches=microbatches, loss_fn=loss_fn)
    return Pipeline(stages, held, runner, group, _tie_group(mesh) if held.config.tied else None)


def build_pipeline(model: nn.Module, schedule: str, microbatches: int, mesh, device: torch.device,
                   shard: Callable[[nn.Module, object], None] | None = None) -> Pipeline:
    """``model`` (built whole) cut into this rank's stages of ``schedule`` over the "pp" ranks of ``mesh`` (a
    DeviceMesh of ("pp",) or ("pp", "dp")); with "dp" ranks, each stage given to ``shard(stage, dp_mesh)`` (FSDP's)."""
    stages = rank_stages(model, schedule, mesh)
    if shard is not None:
        for s in stages:
            shard(s, mesh["dp"])
    return schedule_stages(stages, held_by(stages, model), schedule, microbatches, mesh, device)


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


def training_mesh(device_type: str, world: int, pp: int):
    """The processes as a mesh of ("pp", "dp"): P stages' ranks by world / P data-parallel ranks, a stage's
    data-parallel ranks consecutive (one node's, where they share a fast link); ("pp",) alone without them."""
    from torch.distributed.device_mesh import init_device_mesh

    if world == pp:
        return init_device_mesh(device_type, (pp,), mesh_dim_names=("pp",))
    return init_device_mesh(device_type, (pp, world // pp), mesh_dim_names=("pp", "dp"))


class Numbering:
    """A rank's optimizer state numbered as one process numbers the whole model's (``optimizer_params``), so that
    the ranks' states meet in one checkpoint without clashing, and any layout, or one process, reads it back."""

    def __init__(self, model: nn.Module, held: Stage, optimizer_params: Callable[[nn.Module], list]) -> None:
        """``model`` whole, before its parts are materialised (a tied weight still one); ``held``: this rank's;
        ``optimizer_params``: the optimizer's order of a model's parameters (`fitgpt.optim.optimizer_params`)."""
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for p in optimizer_params(model)]
        self.groups = [[i for i, p in enumerate(optimizer_params(model)) if (p.dim() >= 2) == decay] for decay in (True, False)]
        tied = {"lm_head.weight": "token_embed.weight"} if model.config.tied else {}
        own = {id(p): n for n, p in held.named_parameters()}
        self.index = [order.index(tied.get(own[id(p)], own[id(p)])) for p in optimizer_params(held)]

    def to_whole(self, sd: dict) -> dict:
        """This rank's state dict, numbered as the whole model's, with the whole model's groups."""
        groups = [{**g, "params": whole} for g, whole in zip(sd["param_groups"], self.groups)]
        return {"state": {self.index[i]: s for i, s in sd["state"].items()}, "param_groups": groups}

    def to_own(self, sd: dict, own: dict) -> dict:
        """A whole-numbered state dict as this rank's (``own``: its optimizer's own state dict, for its groups)."""
        state = {i: sd["state"][w] for i, w in enumerate(self.index) if w in sd["state"]}
        groups = [{**g, "params": mine["params"]} for g, mine in zip(sd["param_groups"], own["param_groups"])]
        return {"state": state, "param_groups": groups}
