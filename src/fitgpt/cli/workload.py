"""The flags `fitgpt plan`, `bench` and `fit` share: the model and step as `fitgpt train` takes them (--preset,
--config, --model.*, --optim.*, --batch-size, --grad-accum, --precision, --parallel, under train's names), a device
or a card to plan for, and the ranks; `WorkloadConfig.workload` resolves them into the one `Workload` they all take."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Literal, Optional, TypeVar

import torch
import tyro

from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.config import (
    OptimConfig,
    TrainConfig,
    load_config,
    load_config_named_in,
)
from fitgpt.device import autocast_dtype, resolve_device
from fitgpt.errors import UserError, require_not_empty
from fitgpt.estimate.hardware import CUDA_CONTEXT, Target, find_gpu
from fitgpt.estimate.source import OwnModel, param_count, read_hf_config
from fitgpt.estimate.workload import Workload, workload_for
from fitgpt.memory.allocator import expandable_from
from fitgpt.memory.flops import OpCost
from fitgpt.model.config import ModelConfig, require_positive_ints
from fitgpt.refusals import float8_refusal, launch_refusal, meta_model_refusal
from fitgpt.units import format_bytes, parse_bytes
from fitgpt.utils import host_memory


@dataclass
class WorkloadConfig:
    preset: str = "tiny"
    """Named preset: tiny, small, medium, 3b, llama-tiny or llama-1b."""
    config: Optional[str] = None
    """A JSON config file (for example a run's config.json) applied over the preset."""
    batch_size: Optional[int] = None
    """Sequences per micro-batch (default: the preset's)."""
    context: Optional[int] = None
    """Tokens per sequence: --model.context-length, shorter."""
    grad_accum: Optional[int] = None
    """Micro-batches per step (default: the preset's); above 1, gradients stay allocated between them."""
    target: Optional[Literal["cpu", "cuda"]] = None
    """The device type to plan for, from any machine, on fake tensors (default: this machine's)."""
    gpu: Optional[str] = None
    """The card to plan for (implies --target cuda): h100-80gb, h100-nvl, h100-96gb, h200, a100-80gb, a100-40gb, l4,
    rtx-4090, rtx-3090, t4."""
    gpu_memory: Optional[str] = None
    """For a card not in the table: its memory as nvidia-smi reports the total (e.g. 48GiB), with --gpu naming the
    nearest card for everything else (compute capability, FLOP/s, bandwidth, links)."""
    alloc_conf: Optional[str] = None
    """CUDA's allocator settings to plan for, spelled as PYTORCH_CUDA_ALLOC_CONF (expandable_segments:True is modelled);
    default: this environment's PYTORCH_CUDA_ALLOC_CONF, else PYTORCH_ALLOC_CONF."""
    device: Optional[str] = None
    """Measure on this local device (cpu, cuda, cuda:1, mps) with real tensors instead: the reference, at the cost of real steps."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """As for fitgpt train: auto is bf16 on CUDA (fp16 on cards without bf16), fp32 elsewhere."""
    world_size: int = 1
    """Processes (GPUs) to plan for: memory is reported per rank, --batch-size is per rank."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """With --world-size > 1: ddp (whole model per rank) or fsdp (weights, gradients, optimizer state sharded)."""
    hf_config: Optional[str] = None
    """A Hugging Face causal LM to plan instead of a fitgpt model: its config.json, or the local folder holding one.
    Built from the config alone on the meta device (nothing downloaded, no weights read), attention as the config
    selects (SDPA by default); --context defaults to its max_position_embeddings. Your own loop trains it."""
    model: ModelConfig = None  # filled from --preset and --config (the CLI reads those two first, as train does)
    """The model, as fitgpt train takes it: the preset's or config file's, changed by --model.* flags."""
    optim: OptimConfig = None  # likewise
    """The optimizer, as fitgpt train takes it (its implementation, --optim.impl, sets the step's temporaries)."""

    def __post_init__(self) -> None:
        require_not_empty(self, ("preset", "config", "gpu", "gpu_memory", "device", "hf_config", "alloc_conf"))
        if self.alloc_conf is not None:  # checked as PyTorch will read it, for any target
            expandable_from(self.alloc_conf)
        self._base = load_config(self.preset, self.config)
        self.model = self.model or self._base.model
        self.optim = self.optim or self._base.optim
        if self.hf_config and self.model != dataclasses.replace(self._base.model, context_length=self.model.context_length):
            raise UserError("--model.* flags shape fitgpt's own model; a --hf-config model is shaped by its config.json: "
                            "edit that (or drop --hf-config)")
        self._source = read_hf_config(self.hf_config) if self.hf_config else None
        context = self.context or (self._source.context_length if self._source else None)
        if context is not None and context != self.model.context_length:  # the step's context, whatever the model
            self.model = dataclasses.replace(self.model, context_length=context)
        names = ("batch_size", "context", "grad_accum", "world_size")
        require_positive_ints(self, tuple(n for n in names if getattr(self, n) is not None))
        if self.device is not None and (self.target or self.gpu):
            raise UserError("--device measures on this machine and --target/--gpu plan for another; give one of them")
        if self.gpu_memory is not None and self.gpu is None:
            raise UserError("--gpu-memory sets the memory of the card --gpu names (its compute, bandwidth and links are "
                            "that card's): add --gpu NEAREST, e.g. --gpu a100-80gb --gpu-memory 48GiB")
        if self.gpu is not None:
            self.plan_target()
            if self.target == "cpu":
                raise UserError("--gpu names a CUDA card: drop --target cpu (or --gpu)")
        self._check_launch()

    def _check_launch(self) -> None:
        """What the trainer would refuse, refused before anything is profiled, in the trainer's words (`refusals`)."""
        if self.device:
            device = self.measured_device()
            where, dtype = device.type, autocast_dtype(self.precision, device)
        else:  # a precision the target has (bf16 on a T4 is refused)
            target = self.plan_target()
            where, dtype = target.device, target.autocast_dtype(self.precision)
        cfg = self.launch_config()
        for why in (launch_refusal(cfg, self.world_size or 1, where, dtype, planned=not self.device),
                    None if self._source else meta_model_refusal(cfg), float8_refusal(cfg, self._source is None),
                    self.float8_card_refusal()):
            if why:
                raise UserError(why)

    def float8_card_refusal(self) -> str | None:
        """A named card without float8 matmuls, planned with them (one line)."""
        gpu = self.plan_target().gpu if not self.device and self.launch_config().float8 != "none" else None
        if gpu is None or gpu.sm >= (8, 9):
            return None
        return (f"--float8 needs a card of compute capability 8.9 or more (Ada, Hopper, Blackwell); the {gpu.name} is "
                f"{gpu.sm[0]}.{gpu.sm[1]}: drop --float8, or plan for such a card (--gpu h100-80gb)")

    @functools.cached_property
    def workload(self) -> Workload:
        """The one resolved workload these flags name: measured on --device, else planned on fake tensors."""
        return self.workload_timed_by(None)

    def workload_timed_by(self, cost: OpCost | None) -> Workload:
        """That workload, built anew with the time model ``cost`` (None: the target's own; a roofline where only
        bytes are asked, so that nothing is measured)."""
        if self.device:
            return workload_for(self.train_config(), device=self.measured_device(), fake=False, world_size=self.world_size,
                                cost=cost, source=self._source)
        return workload_for(self.train_config(), target=self.plan_target(), fake=True, world_size=self.world_size,
                            cost=cost, source=self._source)

    def check_policy(self, spec: str) -> None:
        """A policy plan or fit is given, refused before anything is profiled: misspelt, or a chunked loss for a model
        whose head computes its own loss."""
        policy = parse_policy(spec)
        if (policy.loss_chunk_rows or policy.loss_fused_rows) and self.hf_config:
            term = "chunked-loss" if policy.loss_chunk_rows else "fused-loss"
            raise UserError(f"--activation-checkpointing {spec}: {term} needs fitgpt's head (lm_head(x, targets)); "
                            f"a --hf-config model computes its own loss: drop '+{term}'")

    def launch_config(self) -> TrainConfig:
        """The run whose launch the trainer's refusals are asked about: the one these flags name."""
        return self.train_config()

    def train_config(self) -> TrainConfig:
        """The training config these flags name (read once, by ``workload``)."""
        cfg = self._base
        return dataclasses.replace(cfg, model=self.model, optim=self.optim, batch_size=self.batch_size or cfg.batch_size,
                                   grad_accum=self.grad_accum or cfg.grad_accum, precision=self.precision,
                                   parallel=self.parallel, device=self.device or cfg.device)

    def plan_target(self) -> Target:
        if self.gpu:
            gpu = find_gpu(self.gpu)
            if self.gpu_memory:
                memory = parse_bytes(self.gpu_memory, flag="--gpu-memory")
                if memory <= CUDA_CONTEXT:
                    raise UserError(f"--gpu-memory {self.gpu_memory}: less than the CUDA context alone "
                                    f"({format_bytes(CUDA_CONTEXT)}); give the card's total, e.g. 48GiB")
                gpu = dataclasses.replace(gpu, name=f"{gpu.name} with {format_bytes(memory)}", memory=memory)
            return Target("cuda", gpu, expandable_from(self.alloc_conf))
        if self.target:
            return Target(self.target, expandable_segments=self.target == "cuda" and expandable_from(self.alloc_conf))
        return Target(self.measured_device().type if self.device else resolve_device("auto").type)

    def measured_device(self) -> torch.device:
        try:
            return resolve_device(self.device)
        except UserError as e:
            raise UserError(f"{e}; to plan for a device this machine lacks, use --target cuda or --gpu NAME "
                            "instead of --device") from None


@dataclass
class BudgetConfig(WorkloadConfig):
    memory_budget: Optional[str] = None
    """Peak memory of a training step to fit in, e.g. 6GiB, 512MiB, 8GB (default with --gpu: what the card leaves
    for tensors)."""
    host_memory: Optional[str] = None
    """Host memory the optimizer may pin with --optim.offload (and fit --largest-model's rung on the host), e.g. 128GiB
    (default: this machine's, as its OS reports it: plan on the machine the card is in)."""
    tensor_parallel: int = 1
    """As for fitgpt train: one rank of a group of this many, each block split over them (tensor and sequence
    parallelism), profiled on fake ranks; --world-size (default: this many) is N of them, FSDP over N with
    --parallel fsdp."""
    pipeline_parallel: int = 1
    """As for fitgpt train: the blocks cut into this many stages' ranks, each rank planned on fake ranks running the
    trainer's schedule; --world-size (default: this many) is P x N of them, each stage sharded by FSDP over N."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev"] = "1f1b"
    """As for fitgpt train, with --pipeline-parallel."""
    pipeline_microbatches: int = 0
    """As for fitgpt train, with --pipeline-parallel (0: one a stage)."""
    fsdp_reshard_after_forward: Literal["always", "never", "torchtitan"] = "always"
    """As for fitgpt train, with --parallel fsdp: each block's gathered weights freed after its forward (always), kept
    to its backward (never), or torchtitan's default (never under --pipeline-parallel, else always)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """As for fitgpt train: float8 linears (torchao), planned from their casts, scales and what autograd saves; under
    --parallel fsdp, tensorwise weights all-gathered in float8."""

    def __post_init__(self) -> None:
        require_not_empty(self, ("memory_budget", "host_memory"))
        self._check_split()
        super().__post_init__()
        if not self.memory_budget and not self.gpu:
            raise UserError("--memory-budget is required, e.g. --memory-budget 6GiB (or name the card: --gpu h100-80gb)")
        if self.memory_budget:
            parse_bytes(self.memory_budget)
        if self.host_memory:
            parse_bytes(self.host_memory, flag="--host-memory")
        self._check_weights()

    def _check_split(self) -> None:
        """What planning per tensor-parallel or pipeline rank takes: fitgpt's model on fake ranks, --world-size of them
        (default: one group); the trainer's refusals of the split come with the others (`launch_config`)."""
        tp, pp = self.tensor_parallel, self.pipeline_parallel
        require_positive_ints(self, ("tensor_parallel", "pipeline_parallel"))
        if self.pipeline_microbatches < 0:
            raise UserError("--pipeline-microbatches must not be negative (0: one a stage)")
        for flag, n in (("--tensor-parallel", tp), ("--pipeline-parallel", pp)):
            if n > 1 and (self.hf_config or self.device):
                raise UserError(f"{flag} {n} splits fitgpt's own model, planned on fake ranks: drop "
                                f"{'--hf-config' if self.hf_config else '--device'}")
        if tp * pp > 1 and (self.world_size or 1) == 1:
            self.world_size = tp * pp  # all the ranks: FSDP's x TP's x PP's

    def train_config(self) -> TrainConfig:
        return dataclasses.replace(super().train_config(), tensor_parallel=self.tensor_parallel,
                                   pipeline_parallel=self.pipeline_parallel, pipeline_schedule=self.pipeline_schedule,
                                   pipeline_microbatches=self.pipeline_microbatches,
                                   fsdp_reshard_after_forward=self.fsdp_reshard_after_forward, float8=self.float8)

    def _check_weights(self) -> None:
        """Refused before anything is profiled or timed: the weights alone over the budget (a model 100,000 blocks
        deep, or a learned position table of 10M rows, would otherwise be profiled for minutes to say so)."""
        if self._base.fsdp_offload:  # the weights live in host memory
            return
        ranks = self.weight_shards
        params = param_count(self._source or OwnModel(self.model))
        dtype = self.model.weights_dtype  # fp32 unless pure bf16 (--precision is autocast over the weights)
        weights = (2 if dtype == "bf16" else 4) * params // ranks
        if weights > self.budget:
            shard = f" ({format_bytes(weights)} a rank of {ranks})" if ranks > 1 else f" ({format_bytes(weights)})"
            raise UserError(f"the weights alone, {params:,} parameters in {dtype}{shard}, exceed the budget for the step's "
                            f"tensors ({format_bytes(self.budget)}) before any gradient, optimizer state or activation: "
                            "no checkpointing can help; use fewer blocks (--model.n-blocks), a narrower model "
                            "(--model.n-embed), a shorter --context (a learned position table grows with it), or shard "
                            "the weights over GPUs (--parallel fsdp --world-size N)")

    @property
    def weight_shards(self) -> int:
        """Over how many ranks the weights are split at most: FSDP's, where it is asked for, else the pipeline's."""
        return self.world_size if self.parallel == "fsdp" else self.pipeline_parallel

    @property
    def host_budget(self) -> int:
        """The host memory an offloaded optimizer may pin: --host-memory, or this machine's."""
        return parse_bytes(self.host_memory, flag="--host-memory") if self.host_memory else host_memory()

    @property
    def device_budget(self) -> int:
        """The memory asked for: --memory-budget, or the card's memory less the CUDA context (modelled)."""
        if self.memory_budget:
            return parse_bytes(self.memory_budget)
        return self.plan_target().gpu.memory - CUDA_CONTEXT

    @property
    def budget(self) -> int:
        """Bytes for the step's tensors out of the device budget (`Target.tensor_budget`)."""
        target = self.plan_target()
        budget = target.tensor_budget(self.device_budget)
        if budget <= 0:  # else the message that nothing fits names a negative budget
            given = f"--memory-budget {self.memory_budget}" if self.memory_budget else f"--gpu-memory {self.gpu_memory}"
            raise UserError(f"{given} leaves nothing for the step's tensors once the "
                            f"cuBLAS workspaces ({format_bytes(target.workspace_bytes())}, modelled) are held: "
                            f"raise it above {format_bytes(target.workspace_bytes())}")
        return budget


Flags = TypeVar("Flags", bound=WorkloadConfig)
T = TypeVar("T")


def parse_workload(cls: type[Flags], args: list[str], prog: str) -> Flags:
    """``cls`` from the command line, every setting's default the preset's or config file's, as for fitgpt train:
    --preset and --config are read first."""
    return tyro.cli(cls, default=workload_default(cls, args), args=args, prog=prog)


def unchecked_default(cls: type[T]) -> T:
    """``cls`` with its fields' defaults, its checks not run: tyro reads its defaults from an instance, and this one
    is only that (the parsed one runs the checks, such as that a budget is given)."""
    default = object.__new__(cls)
    for f in dataclasses.fields(cls):
        setattr(default, f.name, f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
    return default


def workload_default(cls: type[Flags], args: list[str]) -> Flags:
    """The defaults ``cls`` is parsed over: the preset's or config file's that ``args`` name."""
    base = load_config_named_in(args)
    default = unchecked_default(cls)
    default.preset, default.config, default.model, default.optim = base.preset, base.config, base.model, base.optim
    default.precision, default.parallel = base.precision, base.parallel  # a config file's, unless a flag says otherwise
    if hasattr(default, "data"):  # fit --time-budget's data
        default.data = base.data
    return default
