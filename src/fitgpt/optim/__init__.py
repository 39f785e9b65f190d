"""The optimizer: AdamW with weight decay on matrices only (PyTorch's, with bf16 moments: ``adamw_bf16``, or torchao's
8/4-bit: ``lowbit``), PyTorch's Adafactor (``factored``), Muon with AdamW (``muon``), or GaLore and APOLLO
(``lowrank``); over bf16 weights, stepped in
fp32 and rounded (``bf16_weights``); stepped after the backward, inside it (``in_backward``) or on the host
(``offload``); and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
import torch.nn as nn

from fitgpt.config import OptimConfig
from fitgpt.model.config import ModelConfig
from fitgpt.optim import lowrank
from fitgpt.optim.adamw_bf16 import AdamWBf16
from fitgpt.optim.bf16_weights import Bf16Weights, rounding_seed
from fitgpt.optim.factored import Adafactor
from fitgpt.optim.in_backward import InBackward
from fitgpt.optim.lowbit import low_bit_adamw
from fitgpt.optim.muon import MuonAdamW, hidden_matrices
from fitgpt.optim.offload import HostOffload
from fitgpt.optim.whole import WholeMatrices, owners, sharing_ranks, splits, steps_whole


def _groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()  # tied weights once
    return [p for p in params if p.dim() >= 2], [p for p in params if p.dim() < 2]


def optimizer_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters in the optimizer's order: the indices of its saved state refer to this list."""
    decay, no_decay = _groups(model)
    return decay + no_decay


def optimizer_impl(cfg: OptimConfig, device: torch.device) -> str:
    """The AdamW implementation that steps on ``device``: ``cfg.impl``, auto resolved (fused on CUDA, and on the host
    of an offloaded state, as torchao's offload does: one pass over each tensor's bytes)."""
    if cfg.name in ("adafactor", "muon") or cfg.projects:
        return "for-loop"
    if cfg.name != "adamw":
        return "torchao"
    if cfg.state_dtype == "bf16":
        return "for-loop"  # AdamWBf16 steps a parameter at a time
    if device.type == "meta":
        return "foreach"  # the planner's stand-in for the host, where fused has no kernel (and no byte is counted)
    return cfg.impl if cfg.impl != "auto" else ("fused" if device.type == "cuda" or cfg.offload else "for-loop")


_NAMES = {"adafactor": "Adafactor (PyTorch's, factored second moments)",
          "muon": "Muon (PyTorch's) on the hidden matrices, AdamW on the rest",
          "galore-adamw": "GaLore AdamW (galore-torch)", "galore-adamw8bit": "GaLore 8-bit AdamW (galore-torch)",
          "galore-adafactor": "GaLore Adafactor (galore-torch)", "apollo": "APOLLO (apollo-torch)",
          "apollo-mini": "APOLLO-Mini (apollo-torch)"}


def describe_optimizer(cfg: OptimConfig, device: torch.device, model: nn.Module | None = None) -> str:
    """E.g. 'AdamW fused' or 'AdamW for-loop, bf16 moments, stepped in the backward'; GaLore's and APOLLO's rank as
    ``model``'s matrices take it."""
    where = torch.device("cpu") if cfg.offload else device
    parts = [f"AdamW {optimizer_impl(cfg, where)}" if cfg.name == "adamw" else _NAMES.get(cfg.name, f"{cfg.name} (torchao)")]
    parts += ["bf16 moments"] if cfg.state_dtype == "bf16" else []
    if cfg.projects:
        limit = lowrank.rank_limit(hidden_matrices(model)) if model is not None else None
        own = lowrank.settings(cfg.name, cfg.rank, cfg.update_proj_gap, cfg.proj_scale, limit)
        parts += [f"rank {own['rank']}, refreshed every {own['update_proj_gap']} steps, scale {own['scale']:g}"]
    if cfg.offload:
        parts += ["state and step on the host" + (", each gradient freed on the card once copied" if cfg.in_backward else "")]
    elif cfg.in_backward:
        parts += ["stepped in the backward" + (" (two passes a step, to clip)" if cfg.clips_in_two_passes else "")]
    return ", ".join(parts)


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device,
                    seed: int | None = None) -> torch.optim.Optimizer | InBackward | HostOffload | WholeMatrices:
    """AdamW over ``model`` as it steps on ``device`` (its implementation: ``cfg.impl``; its moments' dtype:
    ``cfg.state_dtype``); with ``cfg.in_backward``, one per parameter, stepped by hooks during the backward; with
    ``cfg.offload``, on the host (``cfg.in_backward`` then frees each gradient on the card once it is copied out).
    Over parameters split across ranks, AdamW steps each rank's shards; any other optimizer, or pure bf16 weights,
    steps each parameter whole on one rank (``whole``). ``seed``: the run's, from which stochastic rounding draws."""
    decay, no_decay = _groups(model)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = mup_groups(groups, model, cfg.lr)

    hidden = {id(p) for p in hidden_matrices(model)} if cfg.name == "muon" or cfg.projects else set()
    if cfg.projects:  # the attention and MLP matrices projected, as GaLore's and APOLLO's recipes do
        own = lowrank.settings(cfg.name, cfg.rank, cfg.update_proj_gap, cfg.proj_scale,
                               lowrank.rank_limit(hidden_matrices(model)))
        groups = lowrank.projected_groups(groups, hidden, own)
    # The whole model's order (the state dict's indices; a pipeline rank's parts numbered as the whole model's, so
    # that APOLLO's projections and stochastic rounding draw what one process draws for each parameter).
    parts = getattr(model, "numbering", None)
    numbering = {id(p): parts.index[i] if parts is not None else i for i, p in enumerate(decay + no_decay)}
    seeds = {k: i + 1 for k, i in numbering.items()}  # APOLLO's numbering, from 1

    def make(groups: list[dict], on: torch.device = device) -> torch.optim.Optimizer:
        if cfg.name == "adafactor":
            return Adafactor(groups, lr=cfg.lr)
        if cfg.name == "muon":
            return _muon(groups, hidden, cfg)
        if cfg.projects:
            return lowrank.build(cfg.name, groups, cfg.lr, (cfg.beta1, cfg.beta2), seeds)
        if cfg.name != "adamw":
            return low_bit_adamw(cfg.name, groups, cfg.lr, (cfg.beta1, cfg.beta2), on)
        if cfg.state_dtype == "bf16":
            return AdamWBf16(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        impl = optimizer_impl(cfg, on)
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=impl == "fused",
                                 foreach=impl == "foreach")

    if cfg.offload:
        return HostOffload(groups, make, free_grads=cfg.in_backward)
    bf16 = any(p.dtype == torch.bfloat16 for p in decay + no_decay)
    if bf16:  # pure bf16 weights: each step in fp32, then rounded
        stochastic = rounding_seed(seed) if cfg.rounding == "stochastic" else None
        inner = make

        def make(groups: list[dict], on: torch.device = device) -> Bf16Weights:
            return Bf16Weights(groups, lambda g: inner(g, on), stochastic, numbering, kahan=cfg.rounding == "kahan")

    whole = splits(decay + no_decay) and steps_whole(cfg.name, bf16)
    size = _state_size(cfg, hidden, own["rank"] if cfg.projects else 0)
    if cfg.in_backward and whole:  # a whole-matrix step per parameter, each by the owner chosen among them all
        owner = dict(zip(map(id, decay + no_decay), owners([size(p) for p in decay + no_decay],
                                                                  len(sharing_ranks(decay + no_decay)[1]))))
        return InBackward(groups, lambda g: WholeMatrices(g, make, owner=[owner[id(g[0]["params"][0])]]))
    if cfg.in_backward:
        return InBackward(groups, make)
    if whole:
        return WholeMatrices(groups, make, size)
    return make(groups)


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How ``cfg``'s optimizer numbers and groups a model's parameters in its state dict: what a pipeline rank needs
    to write its part of one process's state dict (`fitgpt.parallel.stages.Numbering`)."""

    cfg: OptimConfig

    def order(self, model: nn.Module) -> list[nn.Parameter]:
        """The parameters in the state dict's order (`optimizer_params`)."""
        return optimizer_params(model)

    def groups(self, model: nn.Module) -> list[dict]:
        """The state dict's parameter groups over ``model``, each naming its parameters by their place in ``order``:
        of an optimizer built for it on the host and never stepped (no state made), so that they are the groups a
        checkpoint of that optimizer holds, however it splits them (muP's, Muon's parts, GaLore's and APOLLO's
        projected runs)."""
        return build_optimizer(model, self.cfg, torch.device("cpu"), seed=0).state_dict()["param_groups"]


def _state_size(cfg: OptimConfig, hidden: set[int], rank: int):
    """About how many bytes of state ``cfg``'s optimizer keeps for a parameter: what `WholeMatrices` balances across
    the ranks (``hidden``: the ids of the matrices Muon steps or a projection projects; ``rank``: its rank)."""
    factored = cfg.name in ("adafactor", "galore-adafactor")

    def size(p: torch.Tensor) -> int:
        n, shape = p.numel(), tuple(p.shape)
        if id(p) in hidden and cfg.name == "muon":
            state = 4 * n  # one fp32 momentum buffer
        elif id(p) in hidden and cfg.projects:  # the projector (r x the shorter side), the projected gradient's moments
            r, long = min(rank, min(shape)), max(shape)
            state = 4 * r * min(shape) + (4 * (long + r) if factored else 8 * r * long)
        elif factored:
            state = 4 * (shape[0] + shape[1]) if len(shape) == 2 else 4 * n  # a row and a column, or every value
        elif cfg.name in ("adamw8bit", "adamw4bit") and n >= 4096:
            state = n * (2 if cfg.name == "adamw8bit" else 1) + 8 * (n // 256)  # codes and block scales
        else:
            state = n * (4 if cfg.state_dtype == "bf16" else 8)
        kahan = 2 * n if cfg.rounding == "kahan" and p.dtype == torch.bfloat16 else 0
        return 4 + state + kahan  # and a step count

    return size


def _muon(groups: list[dict], hidden: set[int], cfg: OptimConfig) -> torch.optim.Optimizer | MuonAdamW:
    """Muon over the hidden matrices among ``groups``, AdamW (for-loop) over the rest: one of them, or both as one."""
    def part(inside: bool) -> list[dict]:
        # by the parameter a stand-in (pure bf16 weights' fp32 one, or a whole one) stands for
        split = [{**g, "params": [p for p in g["params"] if (id(getattr(p, "stands_for", p)) in hidden) == inside]}
                 for g in groups]
        return [g for g in split if g["params"]]

    matrices, rest = part(True), part(False)
    muon = torch.optim.Muon(matrices, lr=cfg.lr, adjust_lr_fn="match_rms_adamw") if matrices else None
    adamw = torch.optim.AdamW(rest, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), foreach=False) if rest else None
    if muon is None or adamw is None:
        return muon or adamw
    return MuonAdamW(muon, adamw, [p for g in groups for p in g["params"]])


def mup_groups(groups: list[dict], model: nn.Module, lr: float) -> list[dict]:
    """``groups`` with muP's per-width learning rates, where ``model`` is a muP one (`ModelConfig.mup_base_width`):
    its hidden matrices' learning rate divided by the width multiplier m and their weight decay multiplied by it (so
    AdamW's decoupled decay, lr x wd, stays the base shape's), in groups of their own marked ``lr_scale`` (what
    `set_lr` keeps). Each group is cut into runs of consecutive parameters, so that the parameters keep their order
    (the optimizer's state is numbered by it)."""
    config = next((m.config for m in model.modules() if isinstance(getattr(m, "config", None), ModelConfig)), None)
    mult = config.width_mult if config is not None else 1.0
    if mult == 1.0:
        return groups
    hidden = {id(p) for p in hidden_matrices(model)}
    out = []
    for group in groups:
        for inside, run in itertools.groupby(group["params"], key=lambda p: id(p) in hidden):
            scaled = {"lr": lr / mult, "lr_scale": 1 / mult, "weight_decay": group["weight_decay"] * mult}
            out.append({**group, "params": list(run), **(scaled if inside else {})})
    return out


def set_lr(optimizer: torch.optim.Optimizer | InBackward, lr: float) -> None:
    """Set every parameter group's learning rate, times its muP ``lr_scale`` where it has one (torchao's optimizers
    keep it as a tensor, changed in place)."""
    for group in optimizer.param_groups:
        value = lr * group.get("lr_scale", 1.0)
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(value)
        else:
            group["lr"] = value


def lr_at(step: int, cfg: OptimConfig, max_steps: int | None = None, fraction: float | None = None) -> float:
    """Linear warmup to cfg.lr over warmup_steps, then the decay to cfg.min_lr by the end of the run: over the steps
    after the warmup to ``max_steps``, or (a run of --time-budget) by ``fraction``, the share of the time spent."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if fraction is None:
        # WSD's cooldown is the last steps of the run, so that its stable part is the same whatever the run's length.
        start = 0 if cfg.schedule == "wsd" else cfg.warmup_steps
        fraction = (step - start) / max(1, max_steps - start)
    return decayed_lr(min(1.0, max(0.0, fraction)), cfg)


def decayed_lr(progress: float, cfg: OptimConfig) -> float:
    """The learning rate at ``progress`` (0 to 1) through the run's decay: cosine, or WSD's hold then cooldown."""
    if cfg.schedule == "wsd":
        return cfg.lr - (cfg.lr - cfg.min_lr) * max(0.0, 1.0 - (1.0 - progress) / cfg.cooldown)  # lr exactly, held
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)
