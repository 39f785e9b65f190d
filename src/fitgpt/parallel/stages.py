"""A pipeline's stages: the blocks cut into stages (the embedding on the first, the final norm and the head on the last),
each stage the model with only its own parts, and what a rank holds of its stages, filled with one process's weights
and numbered, for the optimizer's checkpoint, as the whole model.

A stage's blocks of other stages are placeholders without parameters, so every parameter keeps the name it has in the
whole model (a checkpoint's names, and the block indices a checkpointing policy names). Each rank holds one stage
(GPipe, 1F1B) or, interleaved, ``STAGES_PER_RANK`` of them, looped: rank r of P holds stages r, r + P, ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fitgpt.config import STAGES_PER_RANK, V_SCHEDULES


def stage_blocks(n_blocks: int, n_stages: int) -> list[range]:
    """Each stage's blocks, in order: as even as they divide, the first stages one more where they do not (the last
    stage's head and loss weigh as a block or more)."""
    per, extra = divmod(n_blocks, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + per + (1 if s < extra else 0))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Stage(nn.Module):
    """The parts of ``model`` that a stage runs (``blocks``, and the embedding if ``first``, the final norm and the head
    if ``last``), under their names in ``model``. Also what a rank holds of all its stages, to save and step."""

    def __init__(self, model: nn.Module, blocks: list[int], first: bool, last: bool, index: int | None = None) -> None:
        """``index``: the stage's place in the pipeline (None: what a rank holds of all its stages)."""
        super().__init__()
        self.config, self.blocks, self.first, self.last, self.index = model.config, blocks, first, last, index
        if first:
            self.token_embed, self.position_embed = model.token_embed, model.position_embed
            self.embed_dropout = model.embed_dropout
        self.attn_blocks = nn.ModuleList([b if i in blocks else nn.Identity() for i, b in enumerate(model.attn_blocks)])
        if last:
            self.layer_norm, self.lm_head = model.layer_norm, model.lm_head

    @classmethod
    def of(cls, model: nn.Module, index: int, n_stages: int) -> Stage:
        """Stage ``index`` of ``n_stages``."""
        blocks = list(stage_blocks(len(model.attn_blocks), n_stages)[index])
        return cls(model, blocks, index == 0, index == n_stages - 1, index)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, else the hidden states (B, T, C); returns the hidden states (B, T, C),
        normed on the last stage (the head is the loss function's)."""
        if self.first:
            from fitgpt.model.transformer import Transformer

            x = Transformer._pre_attn_pass(self, x)  # (B, T, C): the whole model's, over this stage's parts
        for i in self.blocks:
            x = self.attn_blocks[i](x)
        if not self.last:
            return x
        x = self.layer_norm(x)
        # Under tensor parallelism the normed states are gathered whole (a replicated DTensor): handed on as this
        # rank's copy, which the split head takes as replicated.
        return x.to_local() if hasattr(x, "to_local") else x


def held_by(stages: list[Stage], model: nn.Module) -> Stage:
    """What a rank holds of ``model`` over its ``stages``, as one module (its parameters under their whole names)."""
    blocks = sorted(i for s in stages for i in s.blocks)
    return Stage(model, blocks, any(s.first for s in stages), any(s.last for s in stages))


def stage_indices(schedule: str, pp: int, rank: int) -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds under ``schedule``: looped, r, r + P, ...; in a V, r and 2P - 1 - r."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(STAGES_PER_RANK[schedule])]


def rank_stages(model: nn.Module, schedule: str, mesh) -> list[Stage]:
    """This rank's stages of ``schedule`` over the "pp" ranks of ``mesh`` (`stage_indices`)."""
    group = pp_group(mesh)
    pp, rank = dist.get_world_size(group), dist.get_rank(group)
    return [Stage.of(model, i, pp * STAGES_PER_RANK[schedule]) for i in stage_indices(schedule, pp, rank)]


def stage_policy(policy, stage: Stage):
    """``policy`` (an activation-checkpointing Policy) as ``stage`` takes it: a loss term (chunked, fused) only on the
    last stage, which holds the head."""
    return policy if stage.last else dataclasses.replace(policy, loss_chunk_rows=None, loss_fused_rows=None)


def pp_group(mesh) -> dist.ProcessGroup:
    """The ranks of this rank's pipeline: one of each stage, at this rank's data-parallel and tensor-parallel place."""
    return mesh["pp"].get_group() if mesh.ndim > 1 else mesh.get_group()


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
        fill_whole(whole, init_std(name, p, model.config))
        for module, attr in places.get(id(p), []) + (head if name == "token_embed.weight" else []):
            assign_whole(getattr(module, attr), whole.to(device))


class Numbering:
    """A rank's optimizer state numbered as one process numbers the whole model's, so that the ranks' states meet in
    one checkpoint without clashing, and any layout, or one process, reads it back: each parameter's entries (its
    state, and any other entry keyed by parameter: low-bit AdamW's exact moments) under its whole-model index, and
    the whole model's parameter groups, alike on every rank (DCP keeps one rank's copy of what all of them write)."""

    def __init__(self, model: nn.Module, held: Stage, layout) -> None:
        """``model`` whole, before its parts are materialised (a tied weight still one); ``held``: this rank's;
        ``layout``: how the optimizer numbers and groups a model's parameters (`fitgpt.optim.StateLayout`)."""
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for p in layout.order(model)]
        self.groups = layout.groups(model)
        tied = {"lm_head.weight": "token_embed.weight"} if model.config.tied else {}
        own = {id(p): n for n, p in held.named_parameters()}
        self.index = [order.index(tied.get(own[id(p)], own[id(p)])) for p in layout.order(held)]

    def to_whole(self, sd: dict) -> dict:
        """This rank's state dict, numbered as the whole model's, with the whole model's groups."""
        return {**{k: _renumbered(v, self.index.__getitem__) for k, v in sd.items() if k != "param_groups"},
                "param_groups": self.groups}

    def to_own(self, sd: dict, own: dict) -> dict:
        """A whole-numbered state dict as this rank's (``own``: its optimizer's own state dict, for its groups)."""
        mine = {w: i for i, w in enumerate(self.index)}
        return {**{k: _renumbered(v, mine.get) for k, v in sd.items() if k != "param_groups"},
                "param_groups": own["param_groups"]}


def _renumbered(entries, to: Callable[[int], int | None]):
    """A state dict's entry keyed by parameter index (``state``, low-bit AdamW's exact moments), each key ``to``
    another (None: left out); any other entry as it is."""
    if not isinstance(entries, dict) or not all(str(k).isdigit() for k in entries):
        return entries
    out = {}
    for k, v in entries.items():
        new = to(int(k))
        if new is not None:
            out[new] = v
    return out
