"""The optimizer's settings, ``--optim.*``: which optimizer, its hyperparameters, the learning-rate schedule, and where
and when it steps. Light: imports nothing but the errors (the optimizers themselves are built in `fitgpt.optim`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fitgpt.errors import UserError, require_finite


@dataclass
class OptimConfig:
    """AdamW with warmup, then cosine decay to min_lr (or warmup-stable-decay)."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 30
    """Linear warmup steps from 0 to lr."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """After the warmup: cosine (decay from lr to min_lr over the whole run) or wsd (warmup-stable-decay: lr held,
    then a linear decay to min_lr over the last --optim.cooldown of the run; Hägele et al. 2024 find it matches
    cosine, and a run's loss before each cooldown can be read off as a shorter run's, which is how `fitgpt ladder`
    measures). The run is its steps (--max-steps) or its time (--time-budget)."""
    cooldown: float = 0.2
    """With --optim.schedule wsd: the fraction of the run, at its end, over which the learning rate decays."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to biases, norms)."""
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    impl: Literal["auto", "fused", "foreach", "for-loop"] = "auto"
    """AdamW's implementation: fused (one kernel a step), foreach (multi-tensor ops, torchtitan's default), for-loop
    (a parameter at a time); auto: fused on CUDA, PyTorch's default elsewhere (the for-loop on CPU). Training and
    planning build the same one: their temporaries differ."""
    name: Literal["adamw", "adamw8bit", "adamw4bit", "adafactor", "muon", "galore-adamw", "galore-adamw8bit",
                  "galore-adafactor", "apollo", "apollo-mini"] = "adamw"
    """adamw (PyTorch's), torchao's AdamW with 8-bit or 4-bit block-quantized moments (about 2 or 1 bytes a
    parameter; needs the [lowbit] extra; CUDA, compiled, or the CPU, eager), or adafactor (PyTorch's: no first moment,
    the second factored into a row and a column per matrix, under 0.1 bytes a parameter; the step relative to each
    parameter's RMS, min(lr, 1/sqrt(step)): give it --optim.lr 3e-2, measured within 0.6% of AdamW's loss), or muon
    (PyTorch's Muon on the hidden matrices, one momentum buffer each, its lr matched to AdamW's update RMS; AdamW on
    the embeddings, the head, norms and biases), or GaLore (galore-torch's AdamW, 8-bit AdamW (CUDA only) or
    Adafactor over each attention and MLP matrix's gradient projected on its top --optim.rank singular vectors) or
    APOLLO (apollo-torch's: a random projection's AdamW moments scale the full gradient per channel; apollo-mini: rank
    1, per tensor); these need the [lowrank] extra."""
    rank: int = 0
    """GaLore's and APOLLO's projection rank; 0: the method's own (GaLore 128, APOLLO 256, APOLLO-Mini 1). GaLore's
    LLaMA-7B recipe: 1024."""
    update_proj_gap: int = 0
    """GaLore and APOLLO: steps between refreshes of each projection (an SVD of the gradient, or a new random draw);
    0: the method's own (200). GaLore's LLaMA-7B recipe: 500."""
    proj_scale: float = 0.0
    """GaLore and APOLLO: the scale of the update projected back; 0: the method's own (GaLore 0.25, APOLLO 1,
    APOLLO-Mini 128)."""
    state_dtype: Literal["fp32", "bf16"] = "fp32"
    """The dtype AdamW keeps its two moments in: fp32 (8 bytes a parameter) or bf16 (4; updated in fp32 and rounded
    to nearest, a parameter at a time, on any device)."""
    in_backward: bool = False
    """Step each parameter inside the backward, as soon as its gradient is complete, and free that gradient at once:
    gradients never all exist together (saves 4 bytes a parameter at the peak). Clipping (--optim.grad-clip > 0)
    stays exact by running forward and backward twice a step (the first for the global norm); --optim.grad-clip 0
    runs once. Needs --grad-accum 1 and no fp16; over ranks, FSDP or tensor parallelism (not DDP). With
    --optim.offload: each gradient is freed on the card once copied to the host, which steps after the backward
    (clipping exact in one pass)."""
    rounding: Literal["stochastic", "nearest", "kahan"] = "stochastic"
    """With bf16 weights (--model.weights-dtype bf16): how each parameter's fp32 update is rounded into its bf16
    weight. stochastic: up or down at random, unbiased, so updates under half a bf16 step are kept on average
    (seeded; saved in checkpoints); nearest: as plain bf16 arithmetic would, losing them; kahan: to nearest, what
    the rounding lost kept in a bf16 compensation a parameter (2 more bytes each) and added back at the next step,
    so no update is lost (compensated summation)."""
    offload: bool = False
    """Keep the optimizer's state and step on the host (its CPU and pinned memory) of a CUDA card: the card holds the
    weights, their gradients until the backward copies them out, and only parameters under 4096 values' state
    (torchao's CPUOffloadOptimizer's design). Saves the moments' bytes on the card (8 a parameter with AdamW) for a
    host step and 8 bytes a parameter over the host link each step. One CUDA process, no fp16."""

    def __post_init__(self) -> None:
        require_finite(self, "optim.")
        if not self.lr > 0:
            raise UserError(f"optim.lr must be positive, got {self.lr} (set --optim.lr)")
        if not 0 < self.cooldown <= 1:
            raise UserError(f"optim.cooldown is a fraction of the run in (0, 1], got {self.cooldown} (set --optim.cooldown)")
        if self.cooldown != 0.2 and self.schedule != "wsd":
            raise UserError("--optim.cooldown is the decay of --optim.schedule wsd: add --optim.schedule wsd, or drop it")
        if not 0 <= self.min_lr <= self.lr:
            raise UserError(f"optim.min_lr must be in [0, lr={self.lr}], got {self.min_lr} (set --optim.min-lr)")
        for name in ("warmup_steps", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"optim.{name} must not be negative (set --optim.{name.replace('_', '-')})")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"optim.{name} must be in [0, 1) (set --optim.{name})")
        if self.name != "adamw" and self.state_dtype != "fp32":
            raise UserError(f"--optim.state-dtype is for --optim.name adamw; {self.name} keeps its own state as it "
                            "does: drop one of them")
        if self.name != "adamw" and self.impl != "auto":
            raise UserError(f"--optim.impl chooses PyTorch's AdamW kernel; {self.name} has its own: drop --optim.impl")
        if self.offload and self.name != "adamw":
            raise UserError(f"--optim.offload keeps AdamW's moments in host memory; {self.name} keeps less than AdamW on "
                            "the card already: use --optim.name adamw with --optim.offload, or drop --optim.offload")
        for flag in ("rank", "update_proj_gap", "proj_scale"):
            if getattr(self, flag) < 0:
                raise UserError(f"optim.{flag} must not be negative (set --optim.{flag.replace('_', '-')}; 0: the method's own)")
            if getattr(self, flag) and not self.projects:
                raise UserError(f"--optim.{flag.replace('_', '-')} is a setting of GaLore and APOLLO: use --optim.name "
                                "galore-adamw|galore-adafactor|apollo|apollo-mini, or drop it")
        if self.state_dtype == "bf16" and self.impl in ("fused", "foreach"):
            raise UserError(f"--optim.state-dtype bf16 steps a parameter at a time: drop --optim.impl {self.impl}")


    @property
    def projects(self) -> bool:
        """GaLore or APOLLO: each hidden matrix's gradient projected to a low rank."""
        return self.name.startswith(("galore", "apollo"))

    @property
    def clips_in_two_passes(self) -> bool:
        """A step in the backward that clips runs forward and backward twice (the first for the global norm)."""
        return self.in_backward and self.grad_clip > 0 and not self.offload

    @property
    def steps_in_backward(self) -> bool:
        """The update is applied during the backward (a bad one cannot be skipped): in_backward on the card."""
        return self.in_backward and not self.offload
