"""The training config: one typed dataclass tree that the CLI, presets and run directories share.

Precedence: dataclass defaults < preset file < --config file < command-line flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.data.config import DataConfig
from fitgpt.errors import UserError, require_finite, require_not_empty
from fitgpt.model.config import ModelConfig, require_positive_ints
from fitgpt.optim_config import OptimConfig
from fitgpt.units import parse_bytes, parse_duration


@dataclass
class TrainConfig:
    """Train a GPT from scratch. Flags override the preset, which --config overrides in turn."""

    preset: str = "tiny"
    """Named preset: tiny, small, medium, 3b (GPT-2 blocks), llama-tiny or llama-1b (files in fitgpt/presets/)."""
    config: Optional[str] = None
    """A JSON config file (for example a run's config.json) applied over the preset."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    batch_size: int = 16
    """Sequences per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    max_steps: int = 300
    """Optimizer steps to train for (the learning-rate schedule ends here)."""
    time_budget: Optional[str] = None
    """Train for this long instead of --max-steps, e.g. 8m, 3h, 7d: the run ends when it is spent, its last evaluation
    and checkpoint included, and the learning-rate schedule runs over the time, so that it has decayed at the
    deadline; a resumed run counts the time already spent."""
    eval_interval: int = 100
    """Evaluate on val every this many steps (and at the end)."""
    eval_batches: int = 10
    """Batches per evaluation."""
    log_interval: int = 10
    """Write a metrics line every this many steps."""
    checkpoint_interval: int = 100
    """Save a checkpoint (weights and training state, on disk) every this many steps (and at the end)."""
    keep_last: int = 3
    """Checkpoints to keep; older ones are deleted."""
    async_checkpoint: Literal["auto", "on", "off"] = "auto"
    """Under torchrun, write each checkpoint in the background (on): each rank's state is copied to host memory, then
    written while training goes on (the next save, the end of the run and a stop wait for it); off: the step waits.
    auto: on for CUDA ranks, off for CPU ranks, whose copy would sit in the training's own memory and whose writer
    would take the cores that train. One process always writes synchronously."""
    seed: int = 1337
    device: str = "auto"
    """auto (CUDA, then MPS, then CPU), or a torch device such as cpu, cuda, cuda:1, mps."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """auto: bf16 autocast on CUDA, fp32 elsewhere; fp16 uses a GradScaler."""
    compile: bool = False
    """torch.compile the model (after activation checkpointing is applied; under --parallel fsdp or --tensor-parallel
    each block, before sharding)."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """Float8 linears (torchao, as torchtitan trains them): every block's linear layer multiplies in float8 with
    dynamic scales, one a tensor (tensorwise) or one a row (rowwise); the head stays in --precision. Under --parallel
    fsdp, tensorwise weights are all-gathered in float8. Needs a CUDA card of compute capability 8.9+ (or the CPU)."""
    activation_checkpointing: str = "none"
    """Which activations to recompute in backward instead of keeping: none, block, group:2, every:2, selective,
    block+chunked-loss, ..., or auto (needs --memory-budget)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun: ddp (a full replica per process) or fsdp (weights, gradients and optimizer state sharded)."""
    tensor_parallel: int = 1
    """Under torchrun, split each block over this many processes, all of them (tensor and sequence parallelism)."""
    pipeline_parallel: int = 1
    """Under torchrun, cut the blocks into stages over this many processes (the embedding on the first, the head and
    loss on the last), each micro-batch's activations passed from stage to stage; with more processes, each stage
    sharded by --parallel fsdp over the rest."""
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zero-bubble", "zbv", "dualpipev"] = "1f1b"
    """With --pipeline-parallel: gpipe (every micro-batch's forward, then every backward), 1f1b (a backward as soon as
    it can: at most a stage's count of micro-batches in flight), interleaved-1f1b (two stages a process, looped), or
    PyTorch's zero-bubble schedules, each backward split into the input's gradient (sent on at once) and the weights'
    (run where a stage would wait): interleaved-zero-bubble (interleaved-1f1b's stages), zbv (two stages a process in a
    V: process r holds stages r and 2P - 1 - r, the first and the last on the first process), and dualpipev
    (DeepSeek-V3's DualPipe folded into ZBV's V of stages: one micro-batch's forward paired with another's backward)."""
    pipeline_microbatches: int = 0
    """With --pipeline-parallel: the micro-batches each step's batch is cut into (0: one a stage); must divide
    --batch-size."""
    fsdp_reshard_after_forward: Literal["always", "never", "torchtitan"] = "always"
    """With --parallel fsdp: free each block's gathered weights after its forward and gather them again for its
    backward (always), or keep them gathered from forward to backward (never: a block's whole weights more held each,
    an all-gather fewer); torchtitan: torchtitan's own default, never under --pipeline-parallel (whose schedules would
    gather them again for every micro-batch's backward), always otherwise."""
    fsdp_offload: bool = False
    """With --parallel fsdp: keep parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy);
    the optimizer steps on the CPU. For weights and optimizer state larger than the card."""
    dist_timeout: float = 600.0
    """Seconds a collective waits for the other processes before the run fails (a crashed rank never hangs the rest)."""
    dist_stall_timeout: float = 20.0
    """Under torchrun: seconds a rank's heartbeat (one a second) may stand still before the rank watching it takes it
    for stopped or hung and the run stops, every checkpoint whole (a stopped rank fails no collective before
    --dist-timeout). Raise it where a process may be paused longer (a scheduler's preemption)."""
    memory_budget: Optional[str] = None
    """Peak memory of a training step to plan for with --activation-checkpointing auto or --auto-config, e.g. 6GiB (per
    process under torchrun)."""
    auto_config: bool = False
    """Before training, choose the fastest configuration that fits --memory-budget (micro-batch x --grad-accum for the
    same tokens per step, precision, checkpointing plan), as fitgpt fit prints it, for the model's vocabulary as the
    data gives it. A policy named in --activation-checkpointing (other than none) is kept. One process only."""
    out_dir: Optional[str] = None
    """Run directory; default runs/<preset>."""
    init_from: Optional[str] = None
    """Start from the weights of a local Hugging Face folder (GPT-2 or Llama, written by save_pretrained or fitgpt
    export); its config replaces --model.*, and the data must be tokenized with its tokenizer."""
    resume: Optional[str] = None
    """'latest' or a checkpoint directory to continue from; 'auto': latest if the run has a checkpoint, else start it
    (every restart of `torchrun --max-restarts N` runs the same command: the first starts, the others continue)."""
    overwrite: bool = False
    """Start over in an --out-dir that holds an earlier run: removes that run's checkpoints, metrics and config (nothing else)."""
    progress: bool = True
    """Show a progress bar."""
    tensorboard: bool = True
    """Also log to TensorBoard when it is installed."""
    max_bad_steps: int = 0
    """Skip up to this many steps whose loss is NaN/Inf before stopping (0: stop at the first)."""
    memory_snapshot: int = 0
    """Record the first N steps' memory as a PyTorch memory snapshot, memory_snapshot.pickle in the run directory
    (under torchrun each rank's, memory_snapshot_rank_R.pickle), for pytorch.org/memory_viz or fitgpt plan --compare:
    on CUDA the allocator's own history, elsewhere fitgpt's live-tensor tracker in the same format."""

    def __post_init__(self) -> None:
        require_finite(self)
        require_not_empty(self, ("preset", "config", "device", "activation_checkpointing", "memory_budget", "out_dir",
                                 "init_from", "resume", "time_budget"))
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        require_positive_ints(self, ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_batches", "log_interval",
                                     "checkpoint_interval", "keep_last", "tensor_parallel", "pipeline_parallel"))
        if self.pipeline_microbatches < 0:
            raise UserError("pipeline_microbatches must not be negative (set --pipeline-microbatches; 0: one a stage)")
        if self.resume and self.overwrite:
            raise UserError("--resume continues the run in --out-dir and --overwrite removes it; drop one of them")
        if not self.dist_timeout > 0:
            raise UserError("dist_timeout must be positive (set --dist-timeout)")
        if self.fsdp_reshard_after_forward != "always" and self.parallel != "fsdp":
            raise UserError("--fsdp-reshard-after-forward is FSDP's: add --parallel fsdp, or drop the flag")
        if not self.dist_stall_timeout >= 5:
            raise UserError("dist_stall_timeout must be 5 seconds or more, five heartbeats (set --dist-stall-timeout)")
        if self.max_bad_steps < 0:
            raise UserError("max_bad_steps must not be negative (set --max-bad-steps)")
        if self.memory_snapshot < 0:
            raise UserError("memory_snapshot must not be negative (set --memory-snapshot N, the steps to record)")
        if self.model.weights_dtype == "bf16":
            self._check_bf16_weights()
        elif self.optim.rounding != "stochastic":
            raise UserError(f"--optim.rounding {self.optim.rounding} rounds the updates of bf16 weights; these are fp32: "
                            "add --model.weights-dtype bf16, or drop --optim.rounding")
        if self.fsdp_offload and self.parallel != "fsdp":
            raise UserError("--fsdp-offload is FSDP's: add --parallel fsdp (and launch with torchrun)")
        if self.optim.offload:
            self._check_offload()
        if self.optim.in_backward:
            self._check_in_backward()
        if self.auto_config and not self.memory_budget:
            raise UserError("--auto-config chooses for a budget: add --memory-budget, e.g. --memory-budget 6GiB")
        if self.activation_checkpointing == "auto":
            if not self.memory_budget:
                raise UserError("--activation-checkpointing auto plans for a budget: add --memory-budget, e.g. --memory-budget 6GiB")
        else:
            try:
                # Parsed once, here: the trainer and the CLI read cfg.policy (not a dataclass field: the spec is the setting).
                object.__setattr__(self, "_policy", parse_policy(self.activation_checkpointing))
            except UserError as e:
                raise UserError(f"activation_checkpointing: {e} (set --activation-checkpointing)") from None
            if self.memory_budget and not self.auto_config:
                raise UserError("--memory-budget is for --activation-checkpointing auto or --auto-config; set one of them "
                                 "or drop --memory-budget (fitgpt plan predicts the peak of any fixed policy)")
        if self.memory_budget:
            parse_bytes(self.memory_budget)

    def _check_in_backward(self) -> None:
        """What a step taken inside the backward cannot do: each refusal names the flag to change."""
        why = ("--optim.in-backward frees each gradient on the card as soon as it is ready" if self.optim.offload else
               "--optim.in-backward steps each parameter as its gradient is ready")
        if self.grad_accum > 1:
            raise UserError(f"{why}, so gradients cannot accumulate over micro-batches: use --grad-accum 1 (a larger "
                            "--batch-size for the same tokens per step, with activation checkpointing if it must fit)")
        if self.precision == "fp16":
            raise UserError(f"{why}, before fp16's loss scaler could find an overflow and skip: use --precision bf16")
        if self.max_bad_steps and self.optim.steps_in_backward:
            raise UserError(f"{why}: a step is applied before it is known to be bad and cannot be skipped; "
                            "use --max-bad-steps 0 (the run stops at the first, leaving the last checkpoint as it was)")

    def _check_bf16_weights(self) -> None:
        """What pure bf16 weights cannot be combined with: each refusal names the flag to change."""
        if self.precision == "fp16":
            raise UserError("--model.weights-dtype bf16 computes in bf16: use --precision bf16 or auto, not fp16")
        if self.optim.offload or self.fsdp_offload:
            raise UserError("--model.weights-dtype bf16 steps the weights on the card, a parameter at a time: drop "
                            "--optim.offload / --fsdp-offload (or keep fp32 weights)")

    def _check_offload(self) -> None:
        """What the optimizer on the host cannot do (one card: --parallel and torchrun are refused by the trainer)."""
        if self.precision == "fp16":
            raise UserError("--optim.offload steps fp32 copies on the host, out of reach of fp16's loss scaler: use "
                            "--precision bf16")
        if self.fsdp_offload:
            raise UserError("--optim.offload is one card's optimizer on its host; --fsdp-offload offloads FSDP's shards "
                            "(parameters, gradients and state): keep one of them")

    def background_saves(self, device_type: str) -> bool:  # checkpoints written in the background on this device
        return self.async_checkpoint == "on" or (self.async_checkpoint == "auto" and device_type == "cuda")

    @property
    def policy(self):
        """The parsed activation checkpointing policy (``auto`` has none until it is planned)."""
        if self.activation_checkpointing == "auto":
            raise ValueError("--activation-checkpointing auto becomes a policy only once planned")  # a caller's bug
        return self._policy

    @property
    def budget_seconds(self) -> float | None:
        """--time-budget in seconds (None: the run is --max-steps long)."""
        return parse_duration(self.time_budget) if self.time_budget else None

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir or f"runs/{self.preset}")

    @property
    def microbatches(self) -> int:
        """The pipeline's micro-batches a step: --pipeline-microbatches, or one a stage."""
        return self.pipeline_microbatches or self.pipeline_parallel * STAGES_PER_RANK[self.pipeline_schedule]

    @property
    def reshards_after_forward(self) -> bool:
        """Whether FSDP frees each block's gathered weights after its forward (--fsdp-reshard-after-forward)."""
        policy = self.fsdp_reshard_after_forward
        return policy == "always" or (policy == "torchtitan" and self.pipeline_parallel == 1)

    def model_splits(self) -> int:
        """The processes one data-parallel rank's model is split over: tensor parallelism's times the pipeline's."""
        return self.tensor_parallel * self.pipeline_parallel


# ---- loading from dicts and files ----------------------------------------------------------------

STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "interleaved-zero-bubble": 2, "zbv": 2, "dualpipev": 2}
"""The pipeline stages each process holds under each --pipeline-schedule."""
V_SCHEDULES = ("zbv", "dualpipev")
"""The schedules whose stages sit on the processes in a V (process r of P holds stages r and 2P - 1 - r), not looped."""

PRESETS = ("tiny", "small", "medium", "3b", "llama-tiny", "llama-1b")


def _check_type(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        for opt in options:
            if opt is not type(None):
                return _check_type(value, opt, where)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise UserError(f"{where} must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{where} must be a list of strings, got {value!r}")
        return tuple(value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool) and (type(value) is not tp):
        raise UserError(f"{where} must be {tp.__name__}, got {value!r}")
    return value


def from_dict(cls: type, data: dict, source: str, section: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``: unknown keys and wrong types fail naming the key and file."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: {section or 'the top level'} must be a JSON object")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        where = f"{section}{key}"
        if key not in names:
            raise UserError(f"{source}: unknown key {where!r}; valid keys here: {', '.join(sorted(names))}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value, source, f"{where}.")
        else:
            kwargs[key] = _check_type(value, tp, f"{source}: {where}")
    try:
        return cls(**kwargs)
    except UserError as e:
        raise UserError(f"{source}: {e}") from None


def merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_json(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"config file {p} does not exist (check --config)")
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"config file {p} is not valid JSON: {e}") from None


def preset_dict(name: str) -> dict:
    if name not in PRESETS:
        raise UserError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)} (--preset)")
    return json.loads(resources.files("fitgpt.presets").joinpath(f"{name}.json").read_text())


def load_config(preset: str = "tiny", config: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """Defaults < preset < config file < overrides, as one validated TrainConfig."""
    data: dict = {"preset": preset}
    data = merge(data, preset_dict(preset))
    source = f"preset {preset}"
    if config:
        file_data = read_json(config)
        file_data.pop("preset", None)
        data = merge(data, file_data)
        data["config"] = str(config)
        source = str(config)
    data = merge(data, overrides or {})
    return from_dict(TrainConfig, data, source)


def load_config_named_in(args: list[str]) -> TrainConfig:
    """The config --preset and --config in ``args`` name: the defaults train, plan, fit and bench parse flags over."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", default="tiny")
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(args)
    return load_config(known.preset, known.config)


def to_dict(cfg: TrainConfig) -> dict:  # noqa: D103
    d = dataclasses.asdict(cfg)
    d["data"]["inputs"] = list(d["data"]["inputs"])
    return d
