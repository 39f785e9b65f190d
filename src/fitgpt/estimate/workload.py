"""One training step to estimate, resolved once: the one path from a config to a profile.

`fitgpt plan`, `fit` and `bench`, ``--activation-checkpointing auto`` and ``--auto-config`` all build a
`Workload` with `workload_for` and read profiles, replays and descriptions from it. It is frozen: the
training config, the device planned for, where the profiled step runs (fake tensors or a real
device), the autocast dtype and the per-op cost model are fixed when it is made. A variant (another
micro-batch or precision, as `fitgpt fit` searches them) is a new one, made by `Workload.vary`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from fitgpt.command import train_command
from fitgpt.config import TrainConfig
from fitgpt.device import autocast_dtype
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.profile import StepProfile, fixed_costs, profile_model
from fitgpt.estimate.ranks import RanksBusy, in_own_process
from fitgpt.estimate.replay import predicted_snapshot, simulate_step
from fitgpt.estimate.roofline import roofline
from fitgpt.estimate.source import ModelSource, OwnModel, with_float8
from fitgpt.estimate.timing import calibrate
from fitgpt.memory.flops import OpCost


@dataclass(frozen=True)
class Workload:
    train: TrainConfig
    """The run as it would train: model, micro-batch, accumulation, precision, optimizer, parallelism."""
    target: Target
    """The device planned for (a CUDA card may be modelled from a CPU)."""
    device: torch.device
    """Where the profiled steps run: the CPU for fake tensors, else the device measured on."""
    fake: bool
    """Profiled on fake tensors (shapes only: any size, in seconds); False: real steps on ``device``."""
    dtype: torch.dtype | None
    """The forward's autocast dtype (None: fp32)."""
    cost: OpCost
    """Each op's seconds on the target: measured on ``device`` when it is the target's kind, else a roofline."""
    world_size: int = 1
    """Processes the step is one rank of (profiles are per rank)."""
    source: ModelSource | None = None
    """The model when it is not fitgpt's own (a Hugging Face config's); None: ``train.model``."""

    @property
    def model(self) -> ModelSource:
        """The model profiled: ``source``, or fitgpt's own of ``train.model``."""
        return with_float8(self.source or OwnModel(self.train.model), self.train.float8)

    @property
    def context(self) -> int:
        """Tokens per sequence of the step (``train.model.context_length``, whatever the model)."""
        return self.train.model.context_length

    @property
    def persistent_grads(self) -> bool:
        """DDP keeps every gradient in its buckets between steps (tensor parallelism has no DDP around it)."""
        return self.world_size > 1 and self.train.parallel == "ddp" and self.train.tensor_parallel == 1

    @property
    def fsdp_ranks(self) -> int:
        """Ranks the step is sharded over under FSDP (1: not sharded)."""
        return _fsdp_ranks(self.train, self.world_size)

    def profile(self, batch_size: int | None = None, context: int | None = None,
                extra_options: tuple[str, ...] = ()) -> StepProfile:
        """The step's profile (or that of another micro-batch or context of it), per rank; ``extra_options``: as
        ``profile_model`` takes them (torchtitan's rule, where a policy names it)."""
        t = self.train
        return _on_fake_ranks(profile_model, self.model, batch_size or t.batch_size, context or self.context, self.device,
                              seed=t.seed, fake=self.fake, cost=self.cost, extra_options=extra_options, **self._rank_step())

    def fixed_costs(self) -> dict[str, int | float]:
        """The step's parameters, gradients and optimizer state per rank (``params``, ``grads``, ``optimizer``), as its
        profile counts them, without profiling a step (`fixed_costs`): on fake CPU tensors, the target modelled."""
        return _on_fake_ranks(fixed_costs, self.model, "cpu", **self._rank_step())

    def _rank_step(self) -> dict:
        """What one rank's step is, as ``profile_model`` and ``fixed_costs`` take it."""
        t = self.train
        return {"optim_cfg": t.optim, "grad_accum": t.grad_accum, "dtype": self.dtype, "persistent_grads": self.persistent_grads,
                "target": self.target, "fsdp_ranks": self.fsdp_ranks, "tp_ranks": t.tensor_parallel,
                "reshard_after_forward": t.reshards_after_forward}

    def replay(self, policy: str) -> dict[str, int] | None:
        """For a CUDA target planned here (one process, or one rank under DDP or FSDP): the plan's step replayed
        through CUDA's caching allocator (modelled), giving max_memory_allocated and max_memory_reserved; None
        otherwise."""
        if not (self.target.cuda and self.fake) or "offload" in policy or self.train.fsdp_offload:
            return None  # offload copies nothing on the CPU the replay runs on
        t = self.train
        args = (self.model, policy, t.batch_size, self.context, t.grad_accum, self.dtype, t.optim, self.target)
        return _on_fake_ranks(simulate_step, *args, ranks=self.world_size, parallel=t.parallel, tp=t.tensor_parallel,
                              reshard_after_forward=t.reshards_after_forward)

    def snapshot(self, policy: str) -> dict:
        """The step of ``policy`` as PyTorch's memory snapshot, predicted on fake tensors (`predicted_snapshot`): per rank
        under DDP or FSDP, through CUDA's caching allocator (modelled) for a CUDA target."""
        t = self.train
        args = (self.model, policy, t.batch_size, self.context, t.grad_accum, self.dtype, t.optim, self.target)
        return _on_fake_ranks(predicted_snapshot, *args, ranks=self.world_size, parallel=t.parallel, tp=t.tensor_parallel,
                              reshard_after_forward=t.reshards_after_forward)

    def stages(self, policy: str) -> list:
        """Under --pipeline-parallel: each pipeline rank's plan of ``policy`` (`fitgpt.estimate.pipeline.StageRank`),
        the trainer's pipeline step run as that rank on fake ranks."""
        from fitgpt.estimate.pipeline import plan_pipeline

        t = dataclasses.replace(self.train, activation_checkpointing=policy, memory_budget=None)  # the budget: auto's
        return _on_fake_ranks(plan_pipeline, t, self.world_size, self.dtype, "cpu", self.target)

    def unpipelined(self) -> Workload:
        """The same step without the pipeline: one rank holding every block (FSDP over the data-parallel ranks, where
        there are several), whose time the pipeline's ranks share (`fitgpt.estimate.pipeline.pipeline_step_time`)."""
        t, dp = self.train, self.world_size // self.train.pipeline_parallel
        whole = dataclasses.replace(t, pipeline_parallel=1, parallel=t.parallel if dp > 1 else "ddp")
        return workload_for(whole, target=self.target, device=self.device, fake=self.fake, world_size=dp, cost=self.cost,
                            source=self.source)

    def vary(self, cost: OpCost | None = None, **changes) -> Workload:
        """The same workload with training settings changed (batch_size, grad_accum, precision, parallel). The
        cost model is kept while the autocast dtype is; for another it is ``cost``, or made again."""
        train = dataclasses.replace(self.train, **changes)
        same = _dtype(train.precision, self.target, self.device, self.fake) == self.dtype
        return workload_for(train, target=self.target, device=self.device, fake=self.fake, world_size=self.world_size,
                            cost=self.cost if same else cost, source=self.source)

    def precision_name(self, train: TrainConfig | None = None) -> str:
        """The precision ``train`` (this workload or a variant of it) trains in, as --precision names it (auto: as
        this workload resolved it)."""
        train = train or self.train
        if train.precision != "auto":
            return train.precision
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32")

    def how_to_train(self, train: TrainConfig) -> str:
        """How to run ``train`` (this workload or a variant of it): the fitgpt train (or torchrun) command for fitgpt's
        own model; for another, the call that applies its checkpointing in the user's own training loop."""
        if self.source is None:
            return f"train with: {train_command(train, self.world_size)}"
        precision = self.precision_name(train)
        ranks = f", DDP over {self.world_size} ranks" if self.world_size > 1 else ""
        if _fsdp_ranks(train, self.world_size) > 1:  # as fitgpt.parallel.fsdp_shard shards it
            ranks = (f", FSDP2 over {self.world_size} ranks: fully_shard each block, then the model"
                     + (f", MixedPrecisionPolicy(param_dtype={precision}, reduce_dtype=fp32), no autocast"
                        if precision != "fp32" else ""))
        return (f"in your training loop: apply_activation_checkpointing(model, {train.activation_checkpointing!r}) "
                f"(from fitgpt.activation_checkpoint), batch {train.batch_size} x {self.context}, grad accum "
                f"{train.grad_accum}, precision {precision}{ranks}")

    def where(self) -> str:
        """The device planned for, and how: measured on it, or fake tensors with a modelled CUDA."""
        if not self.fake:
            return f"measured on {self.device}"
        if not self.target.cuda:
            return "cpu (fake tensors)"
        gpu = self.target.gpu
        return f"cuda{' ' + gpu.name if gpu else ''} (fake tensors on this CPU; CUDA modelled)"

    def describe(self, where: str | None = None) -> str:
        """One line: the model, the step's shape, the device (``where``, or how it is estimated) and precision."""
        t = self.train
        accum = f", grad accum {t.grad_accum}" if t.grad_accum > 1 else ""
        ranks = f", per rank of {self.world_size} under {t.parallel}" if self.world_size > 1 else ""
        if t.tensor_parallel > 1:
            dp = self.world_size // t.tensor_parallel
            ranks = f", per rank of {self.world_size} under {f'FSDP {dp} x ' if dp > 1 else ''}TP {t.tensor_parallel}"
        if t.pipeline_parallel > 1:
            dp = self.world_size // t.pipeline_parallel
            ranks = (f", per rank of {self.world_size} under PP {t.pipeline_parallel}{f' x FSDP {dp}' if dp > 1 else ''} "
                     f"({t.pipeline_schedule}, {t.microbatches} micro-batches of {t.batch_size // t.microbatches})")
        if self.source is not None:
            origin = getattr(self.source, "path", "") or "a module"
        else:
            origin = f"{Path(t.config).name} over preset {t.preset}" if t.config else f"preset {t.preset}"
        return (f"{self.model.describe()} ({origin}); batch {t.batch_size} x "
                f"context {self.context}{accum}, {where or self.where()}, {self.dtype or 'fp32'}{ranks}")


def workload_for(cfg: TrainConfig, *, target: Target | None = None, device: torch.device | None = None,
                 fake: bool | None = None, world_size: int = 1, cost: OpCost | None = None,
                 source: ModelSource | None = None) -> Workload:
    """The workload of training ``cfg``.

    ``device``: where real steps run (default: the CPU for fake tensors). ``target``: the device planned for
    (default: ``device``'s kind). ``fake``: profile on fake tensors; by default on a CPU, where they give the
    real step's bytes exactly (tested) in a fraction of the time and memory, while an accelerator is measured,
    as the reference. ``cost``: a cost model to reuse (one calibration serves every variant of a precision).
    ``source``: the model, when it is not fitgpt's own ``cfg.model`` (whose context length stays the step's).
    """
    device = device or torch.device("cpu")
    target = target or Target(device.type)
    # One rank of several split or sharded ones is profiled on fake ranks, whatever the device
    split = _fsdp_ranks(cfg, world_size) > 1 or cfg.tensor_parallel > 1
    fake = device.type == "cpu" or split if fake is None else fake
    if fake and device.type != "cpu":  # one rank of N, profiled in this process: fake CPU tensors, the device modelled
        device = torch.device("cpu")
    dtype = _dtype(cfg.precision, target, device, fake)
    if cost is None:
        if target.cuda and fake:
            cost = roofline(target.gpu, dtype)
        else:
            model = with_float8(source or OwnModel(cfg.model), cfg.float8)
            cost = calibrate(model, cfg.batch_size, cfg.model.context_length, device, dtype, cfg.optim, seed=cfg.seed)
    return Workload(cfg, target, device, fake, dtype, cost, world_size, source)


def _fsdp_ranks(cfg: TrainConfig, world_size: int) -> int:
    """Ranks a step of ``cfg`` is sharded over under FSDP: the data-parallel ones (all but a tensor-parallel
    group's), 1 if not sharded."""
    dp = world_size // cfg.tensor_parallel
    return dp if dp > 1 and cfg.parallel == "fsdp" else 1


def _dtype(precision: str, target: Target, device: torch.device, fake: bool) -> torch.dtype | None:
    """The autocast dtype of ``precision``: as the target trains it when planned on fake tensors (its card is not
    here to ask), as the device measured on does otherwise."""
    return target.autocast_dtype(precision) if fake else autocast_dtype(precision, device)


def _on_fake_ranks(fn, *args, **kw):
    """``fn(*args, **kw)`` here, or, under torchrun (this process in a real group: ``RanksBusy``), in a process of its
    own, where its fake ranks can be made."""
    try:
        return fn(*args, **kw)
    except RanksBusy:
        return in_own_process(fn, *args, **kw)
