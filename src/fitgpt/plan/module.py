"""Plan any ``nn.Module``: ``plan_module(build_model, (batch, context), vocab_size=...)``.

The module is built on the meta device (nothing allocated) and profiled on fake tensors exactly as fitgpt's own
models are (`fitgpt.estimate.source.ModuleModel`): each per-block option ``apply_activation_checkpointing`` gives
it, the fastest plan within a budget, its predicted peak, and on a CUDA card the step replayed through CUDA's
caching allocator (``max_memory_allocated`` and ``max_memory_reserved``). Its forward takes (idx, targets), both
(B, T) token ids, targets shifted by one, and gives a loss, (logits, loss) or an object with ``.loss``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fitgpt.activation_checkpoint.apply import find_blocks
from fitgpt.config import OptimConfig, load_config
from fitgpt.errors import UserError
from fitgpt.estimate.hardware import CUDA_CONTEXT, Target, find_gpu
from fitgpt.estimate.profile import BLOCK_OPTIONS, StepProfile
from fitgpt.estimate.source import ModuleModel
from fitgpt.estimate.workload import workload_for
from fitgpt.memory.snapshot import write_snapshot
from fitgpt.plan.solver import Plan, Prediction, min_peak, predict, solve
from fitgpt.units import parse_bytes


@dataclass
class ModulePlan:
    policy: str
    """What to pass to ``apply_activation_checkpointing(model, policy)``."""
    prediction: Prediction
    """The plan's predicted peak (bytes of the step's tensors), where it falls, and its time."""
    budget: int | None
    """Bytes for the step's tensors the plan was solved within (None: the lowest peak was asked for)."""
    uniform: dict[str, int]
    """Each option on every block, its predicted peak."""
    replay: dict[str, int] | None
    """On a CUDA card: ``max_allocated`` and ``max_reserved`` of the plan's step through CUDA's caching allocator."""
    profile: StepProfile

    @property
    def fits(self) -> bool:
        return self.budget is None or self.prediction.peak <= self.budget


def plan_module(build_model: Callable[[], nn.Module], batch: tuple[int, int], *, vocab_size: int,
                budget: int | str | None = None, gpu: str | None = None, precision: str = "auto", grad_accum: int = 1,
                optim: OptimConfig | None = None, world_size: int = 1, parallel: str = "fsdp",
                snapshot: str | Path | None = None) -> ModulePlan:
    """Plan one training step of the module ``build_model()`` makes, on this CPU or on the CUDA card ``gpu`` (a name
    as ``fitgpt plan --gpu`` takes it), at ``batch`` = (sequences, tokens per sequence), ``grad_accum`` micro-batches
    a step, in ``precision`` (autocast), with AdamW as ``optim`` says. ``world_size`` above 1: the step of one rank
    of that many under ``parallel`` (fsdp: ``fitgpt.parallel.fsdp_shard``, each block then the root; ddp), profiled
    on fake ranks. ``snapshot``: also write the plan's step there as a PyTorch memory snapshot (pytorch.org/memory_viz).

    ``budget``: the memory a step may take (bytes, or "6GiB"); default: the card's memory less the CUDA context, or
    none on a CPU (the lowest-peak plan). The blocks are the model's longest ``nn.ModuleList`` of one type (as
    ``apply_activation_checkpointing`` finds them). On a CPU the time of each op is measured on this machine (real
    steps of the module at a small batch); on a card it is a roofline estimate. Nothing fitting the budget raises
    ``PlanError``, saying by how much and what to change.
    """
    _check_arguments(build_model, batch, vocab_size=vocab_size, budget=budget, gpu=gpu, precision=precision,
                     grad_accum=grad_accum, optim=optim, world_size=world_size, parallel=parallel, snapshot=snapshot)
    b, t = batch
    target = Target("cuda", find_gpu(gpu)) if gpu else Target("cpu")
    with torch.device("meta"):
        model = build_model()
    try:
        n_blocks = len(find_blocks(model)[1])
    except ValueError:
        raise UserError(f"plan_module cuts the step at the model's blocks, found as apply_activation_checkpointing "
                        f"finds them: the longest nn.ModuleList of one module type; {type(model).__name__} has none: "
                        "keep its blocks in an nn.ModuleList") from None
    source = ModuleModel(build_model, vocab_size, t, n_blocks)
    base = load_config("tiny")
    cfg = dataclasses.replace(base, model=dataclasses.replace(base.model, context_length=t, vocab_size=vocab_size),
                              batch_size=b, grad_accum=grad_accum, precision=precision, optim=optim or base.optim,
                              parallel=parallel)
    w = workload_for(cfg, target=target, fake=True, source=source, world_size=world_size)
    profile = w.profile()
    room = _room(budget, target)
    plan, pred = solve(profile, room) if room is not None else min_peak(profile)
    if snapshot is not None:
        write_snapshot(w.snapshot(plan.spec()), snapshot)
    return ModulePlan(policy=plan.spec(), prediction=pred, budget=room,
                      uniform={o: predict(profile, Plan.uniform(n_blocks, o)).peak for o in BLOCK_OPTIONS},
                      replay=w.replay(plan.spec()), profile=profile)


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_arguments(build_model, batch, **kw) -> None:
    """Every argument checked before anything is built or profiled: a UserError naming it and what it takes."""
    def bad(name: str, takes: str) -> UserError:
        return UserError(f"plan_module: {name}={kw[name] if name in kw else batch!r} is not {takes}")

    if not callable(build_model):
        raise UserError(f"plan_module: build_model={build_model!r} is not a function that builds the module")
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(_whole(x) for x in batch)):
        raise bad("batch", "(sequences, tokens per sequence), two whole numbers of at least 1")
    for name in ("vocab_size", "grad_accum", "world_size"):
        if not _whole(kw[name]):
            raise bad(name, "a whole number of at least 1 (an int)")
    budget = kw["budget"]
    if budget is not None and not (isinstance(budget, str) or _whole(budget)):
        raise bad("budget", 'bytes (an int) or a size such as "6GiB"')
    if kw["precision"] not in ("auto", "fp32", "bf16", "fp16"):
        raise bad("precision", "one of auto, fp32, bf16, fp16")
    if kw["parallel"] not in ("fsdp", "ddp"):
        raise bad("parallel", "fsdp or ddp")
    if kw["gpu"] is not None and not isinstance(kw["gpu"], str):
        raise bad("gpu", 'a card\'s name, such as "h100-80gb"')
    if kw["optim"] is not None and not isinstance(kw["optim"], OptimConfig):
        raise bad("optim", "an OptimConfig")
    if kw["snapshot"] is not None and not isinstance(kw["snapshot"], (str, Path)):
        raise bad("snapshot", "a file path")


def _room(budget: int | str | None, target: Target) -> int | None:
    """Bytes for the step's tensors: the budget (or the card's memory less the CUDA context) less cuBLAS workspaces."""
    if budget is None and target.gpu is None:
        return None
    device_bytes = parse_bytes(budget) if isinstance(budget, str) else budget
    if device_bytes is None:
        device_bytes = target.gpu.memory - CUDA_CONTEXT
    return target.tensor_budget(device_bytes)
