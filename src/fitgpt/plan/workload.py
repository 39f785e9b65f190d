"""What `fitgpt plan`, `bench` and `fit` measure: a preset or config, a batch shape, a device, a precision."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import torch
import tyro

from fitgpt.config import TrainConfig, load_config
from fitgpt.device import autocast_dtype, resolve_device
from fitgpt.errors import user_errors
from fitgpt.memory.flops import OpCost
from fitgpt.memory.units import parse_bytes
from fitgpt.model import ModelConfig
from fitgpt.model.config import require_positive_ints
from fitgpt.plan.profile import StepProfile, per_rank, profile_model
from fitgpt.plan.simulate import simulate_step
from fitgpt.plan.target import CUDA_CONTEXT, Target, find_gpu
from fitgpt.plan.timing import calibrate, roofline


@dataclass
class WorkloadConfig:
    preset: str = "tiny"
    """Named preset: tiny, small, medium, 3b, llama-tiny or llama-1b."""
    config: Optional[str] = None
    """A JSON config file (for example a run's config.json) applied over the preset."""
    batch_size: Optional[int] = None
    """Sequences per micro-batch (default: the preset's)."""
    context: Optional[int] = None
    """Tokens per sequence (default: the preset's model.context_length)."""
    grad_accum: Optional[int] = None
    """Micro-batches per step (default: the preset's); above 1, gradients stay allocated between them."""
    target: Optional[Literal["cpu", "cuda"]] = None
    """The device type to plan for, from any machine, on fake tensors (default: this machine's)."""
    gpu: Optional[str] = None
    """The card to plan for (implies --target cuda): h100-80gb, h200, a100-80gb, a100-40gb, l4, rtx-4090, rtx-3090, t4."""
    device: Optional[str] = None
    """Measure on this local device (cpu, cuda, cuda:1, mps) with real tensors instead: the reference, at the cost of real steps."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """As for fitgpt train: auto is bf16 on CUDA (fp16 on cards without bf16), fp32 elsewhere."""
    world_size: int = 1
    """Processes (GPUs) to plan for: memory is reported per rank, --batch-size is per rank."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """With --world-size > 1: ddp (whole model per rank) or fsdp (weights, gradients, optimizer state sharded)."""
    base: tyro.conf.Suppress[Optional[TrainConfig]] = None
    """A training config to plan for instead of --preset/--config (``fitgpt train --auto-config``)."""

    @user_errors
    def __post_init__(self) -> None:
        self._cost: OpCost | None = None
        names = ("batch_size", "context", "grad_accum", "world_size")
        require_positive_ints(self, tuple(n for n in names if getattr(self, n) is not None))
        if self.device is not None and (self.target or self.gpu):
            raise ValueError("--device measures on this machine and --target/--gpu plan for another; give one of them")
        if self.gpu is not None:
            find_gpu(self.gpu)
            if self.target == "cpu":
                raise ValueError("--gpu names a CUDA card: drop --target cpu (or --gpu)")
        if self.device is None:
            self.plan_target().autocast_dtype(self.precision)  # a precision the target has (bf16 on a T4 is refused)

    def train_config(self) -> TrainConfig:
        cfg = self.base or load_config(self.preset, self.config)
        model = cfg.model
        if self.context is not None:
            model = dataclasses.replace(model, context_length=self.context)
        return dataclasses.replace(
            cfg, model=model, batch_size=self.batch_size or cfg.batch_size, grad_accum=self.grad_accum or cfg.grad_accum,
            device=self.device or self.plan_target().device, precision=self.precision,
        )

    @property
    def model_config(self) -> ModelConfig:
        return self.train_config().model

    @property
    def fake(self) -> bool:
        """Planned on fake tensors (no --device to measure on)."""
        return self.device is None

    def plan_target(self) -> Target:
        if self.gpu:
            return Target("cuda", find_gpu(self.gpu))
        if self.target:
            return Target(self.target)
        return Target(self.torch_device().type if self.device else resolve_device("auto").type)

    def torch_device(self) -> torch.device:
        """Where the profiled step runs: the --device measured on, or the CPU for fake tensors (any target)."""
        if not self.device:
            return torch.device("cpu")
        try:
            return resolve_device(self.device)
        except ValueError as e:
            raise ValueError(f"{e}; to plan for a device this machine lacks, use --target cuda or --gpu NAME "
                             "instead of --device") from None

    def dtype(self) -> torch.dtype | None:
        if self.device:
            return autocast_dtype(self.precision, self.torch_device())
        return self.plan_target().autocast_dtype(self.precision)

    def profile(self, batch_size: int | None = None, context: int | None = None) -> StepProfile:
        """Profile this workload (or another batch/context of it), per rank when world_size > 1."""
        tcfg = self.train_config()
        ddp = self.world_size > 1 and self.parallel == "ddp"
        prof = profile_model(self.model_config, batch_size or tcfg.batch_size, context or tcfg.model.context_length,
                             self.torch_device(), tcfg.optim, tcfg.grad_accum, self.dtype(), persistent_grads=ddp,
                             fake=self.fake, target=self.plan_target(), cost=self.cost_model())
        return per_rank(prof, self.world_size, self.parallel)

    def cost_model(self) -> OpCost:
        """Each op's seconds on the target: measured on the device at hand when it is of the target's kind, the
        card's roofline when it is not (a CUDA card planned from here). Calibrated once per workload."""
        if self._cost is None:
            t, tcfg = self.plan_target(), self.train_config()
            if t.cuda and self.fake:
                self._cost = roofline(t.gpu, self.dtype())
            else:
                self._cost = calibrate(tcfg.model, tcfg.batch_size, tcfg.model.context_length, self.torch_device(), self.dtype(),
                                       tcfg.optim)
        return self._cost

    def replay(self, policy: str) -> dict[str, int] | None:
        """For a CUDA target planned here (one process): the plan's step replayed through CUDA's caching
        allocator (modelled), giving max_memory_allocated and max_memory_reserved; None otherwise."""
        t = self.plan_target()
        if not (t.cuda and self.fake and self.world_size == 1) or "offload" in policy:
            return None  # offload copies nothing on the CPU the replay runs on
        tcfg = self.train_config()
        return simulate_step(tcfg.model, policy, tcfg.batch_size, tcfg.model.context_length, tcfg.grad_accum, self.dtype(),
                             tcfg.optim, t)

    def where(self) -> str:
        """The device planned for, and how: measured on it, or fake tensors with a modelled CUDA."""
        if self.device:
            return f"measured on {self.torch_device()}"
        t = self.plan_target()
        if not t.cuda:
            return "cpu (fake tensors)"
        return f"cuda{' ' + t.gpu.name if t.gpu else ''} (fake tensors on this CPU; CUDA modelled)"

    def describe(self) -> str:
        cfg = self.train_config()
        m = cfg.model
        accum = f", grad accum {cfg.grad_accum}" if cfg.grad_accum > 1 else ""
        ranks = f", per rank of {self.world_size} under {self.parallel}" if self.world_size > 1 else ""
        return (f"{cfg.preset} ({m.n_blocks} blocks x {m.n_embed} wide, vocab {m.vocab_size}), batch {cfg.batch_size} x "
                f"context {m.context_length}{accum}, {self.where()}, {self.dtype() or 'fp32'}{ranks}")


@dataclass
class BudgetConfig(WorkloadConfig):
    memory_budget: str = ""
    """Peak memory of a training step to fit in, e.g. 6GiB, 512MiB, 8GB (default with --gpu: what the card leaves
    for tensors)."""

    @user_errors
    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.memory_budget and not self.gpu:
            raise ValueError("--memory-budget is required, e.g. --memory-budget 6GiB (or name the card: --gpu h100-80gb)")
        if self.memory_budget:
            parse_bytes(self.memory_budget)

    @property
    def device_budget(self) -> int:
        """The memory asked for: --memory-budget, or the card's memory less the CUDA context (modelled)."""
        if self.memory_budget:
            return parse_bytes(self.memory_budget)
        return self.plan_target().gpu.memory - CUDA_CONTEXT

    @property
    def budget(self) -> int:
        """Bytes for the step's tensors: the device budget less what the allocator holds besides them on
        the target (cuBLAS workspaces on CUDA, modelled), so that max_memory_allocated stays within it."""
        return self.device_budget - self.plan_target().workspace_bytes()
