"""`fitgpt fit --largest-model`: the largest model of the preset's shape that trains within a budget, under each
optimizer memory setting, with the fastest checkpointing plan for it.

The family is the preset (or --model.*) scaled in depth at its own aspect ratio: width per block, head size, MLP
ratio and key/value heads kept (GPT-2 small: 64 wide a block, heads of 64; llama-1b: 128 a block, heads of 64, 8
key/value heads, an MLP 4x wide), as nanochat sizes its models by depth alone. Each size is judged on its own exact
profile (fake tensors, deepened), solved for the fastest plan within the budget (any per-block option, any head:
plain, chunked or fused loss). The search starts from the size whose fixed bytes fill the budget and walks to the
boundary with a secant step on the measured peak, so each setting takes a few profiles.

The settings form a ladder, each adding one technique, so that what each buys and costs (tokens/s) can be read off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from fitgpt.config import OptimConfig
from fitgpt.errors import UserError
from fitgpt.estimate.source import OwnModel, param_count
from fitgpt.estimate.workload import Workload
from fitgpt.model import ModelConfig
from fitgpt.plan.solver import Plan, PlanError, Prediction, min_peak, solve
from fitgpt.utils import in_processes

# Clipping as the run asks: with the step in the backward it costs a second forward and backward (tokens/s shows it),
# no memory.
LADDER: tuple[tuple[str, dict], ...] = (
    ("AdamW", {}),
    ("AdamW, bf16 moments", {"state_dtype": "bf16"}),
    ("AdamW, bf16 moments, step in the backward", {"state_dtype": "bf16", "in_backward": True}),
    ("8-bit AdamW, step in the backward", {"name": "adamw8bit", "in_backward": True}),
    ("4-bit AdamW, step in the backward", {"name": "adamw4bit", "in_backward": True}),
    # Adafactor's lr caps a step relative to each weight's RMS: 3e-2 is within 0.6% of AdamW's loss on the README's
    # first run, the preset's 3e-3 is 35% worse (benchmarks/RESULTS.md).
    ("Adafactor, step in the backward", {"name": "adafactor", "in_backward": True, "lr": 3e-2, "min_lr": 3e-3}),
    ("Adafactor, bf16 weights (stochastic rounding), step in the backward",
     {"name": "adafactor", "in_backward": True, "lr": 3e-2, "min_lr": 3e-3, "weights_dtype": "bf16"}),
    # APOLLO-Mini: a rank-1 projection's moments scale each whole gradient (apollo-torch, the [lowrank] extra); lr 1e-2
    # as its authors' recipes run it: 1.77% under AdamW's loss on the README's first run (the preset's 3e-3: 0.98%).
    ("APOLLO-Mini, bf16 weights (stochastic rounding), step in the backward",
     {"name": "apollo-mini", "in_backward": True, "lr": 1e-2, "min_lr": 1e-3, "weights_dtype": "bf16"}),
)
LOSS_COST: dict[str, str] = {
    "AdamW": "reference",
    "AdamW, bf16 moments": "+0.01%",
    "AdamW, bf16 moments, step in the backward": "+0.01%",
    "8-bit AdamW, step in the backward": "+0.11%; 5.3M run: -0.39%",
    "4-bit AdamW, step in the backward": "-0.62%",
    "Adafactor, step in the backward": "+0.57%; 5.3M run: +3.82%",
    "Adafactor, bf16 weights (stochastic rounding), step in the backward": "+0.57%; 5.3M run: +3.82% (bf16 weights: -0.13%)",
    "APOLLO-Mini, bf16 weights (stochastic rounding), step in the backward": "-1.77%; 5.3M run: +1.98% (bf16 weights: -0.13%)",
    "AdamW on the host, each gradient freed once copied": "+0.00% (AdamW's weights)",
}
"""Each rung's validation loss against AdamW fp32's after the same steps: on the README's first run (``python
benchmarks/optimizers.py quality``), and where measured on the larger run (``--size larger``: 5.3M parameters, 1,000
steps); bf16 weights on a smaller run (benchmarks/RESULTS.md). One run each, the same seed and data."""
LADDER_SETTINGS = ("name", "state_dtype", "in_backward", "offload")
"""The OptimConfig fields the ladder sets, a row each (and the model's weights_dtype)."""
MODEL_SETTINGS = ("weights_dtype",)
ON_THE_HOST = ("AdamW on the host, each gradient freed once copied", {"offload": True, "in_backward": True})
"""The last rung for a CUDA card (--optim.offload needs one): 4 bytes a parameter on the card."""
MAX_BLOCKS = 256


def scaled(base: ModelConfig, n_blocks: int, split: int = 1) -> ModelConfig:
    """``base``'s shape at ``n_blocks`` blocks: as wide as its width per block says, in whole heads of its size, a
    multiple of ``split`` of them (tensor parallelism's degree: each rank its share of the heads)."""
    head = base.head_dim
    n_head = split * max(1, round(base.n_embed / base.n_blocks * n_blocks / head / split))
    width = n_head * head
    kv = math.gcd(n_head, base.kv_heads) if base.n_kv_head else None
    ffn = -(-base.mlp_hidden * width // base.n_embed // 64) * 64 if base.ffn_hidden else None
    return dataclasses.replace(base, n_blocks=n_blocks, n_embed=width, n_head=n_head, n_kv_head=kv, ffn_hidden=ffn)


@dataclass(frozen=True)
class Largest:
    setting: str
    optim: OptimConfig
    model: ModelConfig | None
    """The largest that fits (None: not even one block)."""
    params: int = 0
    plan: Plan | None = None
    prediction: Prediction | None = None
    profiles: int = 0
    note: str = ""
    tokens: int = 0
    """Tokens a step."""
    host: int = 0
    """Host memory the optimizer holds (offloaded)."""
    precision: str = "auto"
    """--precision to train it with (fp32 where the card's auto, fp16, cannot run the setting)."""
    settings: tuple[tuple[str, object], ...] = ()
    """The training config's other fields it trains with (a pipeline row's layout: `fitgpt.plan.family_pipeline`)."""

    @property
    def tokens_per_s(self) -> float:
        p = self.prediction
        return 0.0 if p is None or not p.step_time else self.tokens / p.step_time


def largest_model(w: Workload, budget: int, ladder: tuple[tuple[str, dict], ...] | None = None,
                  host_budget: int | None = None, workers: int | None = None) -> list[Largest]:
    """For each setting of ``ladder`` (default: ``LADDER``, and ``ON_THE_HOST`` for a CUDA card), the largest model of
    ``w``'s shape whose step (``w``'s batch and context, no accumulation: a step inside the backward cannot
    accumulate) fits ``budget``, and what an offloaded optimizer pins ``host_budget`` (None: no bound); with its
    fastest plan. The settings are independent searches, each single-threaded Python on fake tensors: they run in
    ``workers`` processes (default: one per CPU core, at most one per setting)."""
    # Several ranks offload with --fsdp-offload, not the one card's host optimizer.
    rungs = ladder or LADDER + ((ON_THE_HOST,) if w.target.cuda and w.world_size == 1 else ())
    jobs = []
    for name, changes in rungs:
        model, optim = rung_settings(w, changes)
        jobs.append((w.vary(model=model) if model != w.train.model else w, budget, name, optim, host_budget))
    # The slowest searches first (low-bit steps, then steps in the backward), so that no core idles at the end.
    order = sorted(range(len(jobs)), key=lambda i: (jobs[i][3].name != "adamw", jobs[i][3].in_backward), reverse=True)
    done = dict(zip(order, in_processes(_rung, [jobs[i] for i in order], workers)))
    return [done[i] for i in range(len(jobs))]


def rung_settings(w: Workload, changes: dict) -> tuple[ModelConfig, OptimConfig]:
    """``w``'s model and optimizer with a rung's changes applied (its model settings: pure bf16 weights)."""
    model = dataclasses.replace(w.train.model, **{k: v for k, v in changes.items() if k in MODEL_SETTINGS})
    optim = dataclasses.replace(w.train.optim, **{k: v for k, v in changes.items() if k not in MODEL_SETTINGS})
    return model, optim


def _rung(w: Workload, budget: int, name: str, optim: OptimConfig, host_budget: int | None) -> Largest:
    from fitgpt.refusals import launch_refusal

    # Without accumulation, as the rung is searched: a step in the backward refuses it.
    if w.world_size > 1 and (why := launch_refusal(dataclasses.replace(w.train, optim=optim, grad_accum=1), w.world_size,
                                                     w.target.device, None, planned=True)):
        return Largest(name, optim, None, note=why.split(":")[0])  # a setting these ranks cannot train: the row says
    if (optim.in_backward or optim.offload) and w.dtype == torch.float16:
        # A step in the backward or on the host is out of reach of fp16's loss scaler: the trainer runs it in fp32.
        w, name = w.vary(precision="fp32"), f"{name} (fp32: not with fp16's scaler)"
    try:
        return _largest_for(w, budget, name, optim, host_budget)
    except UserError as e:  # torchao missing: the row says so
        return Largest(name, optim, None, note=str(e))


def _largest_for(w: Workload, budget: int, name: str, optim: OptimConfig, host_budget: int | None) -> Largest:
    base, split = w.train.model, w.train.tensor_parallel
    solved: dict[int, tuple[Plan, Prediction] | None] = {}
    lowest: dict[int, int] = {}  # depth -> the lowest peak any plan reaches (what the search steers by)
    host: dict[int, int] = {}

    def probe(n: int) -> bool:
        profile = w.vary(model=scaled(base, n, split), optim=optim, grad_accum=1).profile()
        lowest[n], host[n] = min_peak(profile)[1].peak, profile.host
        if host_budget is not None and profile.host > host_budget:
            # Too large for the host: steer by that excess, scaled to the card's budget (both grow with the depth).
            lowest[n] = max(lowest[n], int(budget * profile.host / host_budget))
            solved[n] = None
            return False
        try:
            solved[n] = solve(profile, budget)
        except PlanError:
            solved[n] = None
        return solved[n] is not None

    lo = walk_depths(first_guess(base, budget, optim, host_budget, split), probe, lowest, budget)
    if lo == 0:
        return Largest(name, optim, None, profiles=len(solved))
    model = scaled(base, lo, split)
    plan, pred = solved[lo]
    return Largest(name, optim, model, param_count(OwnModel(model)), plan, pred, len(solved), tokens=w.train.batch_size * w.context,
                   host=host[lo], precision=w.train.precision)


def walk_depths(first: int, probe, lowest: dict[int, int], budget: int, floor: int = 0) -> int:
    """The largest depth ``probe(n)`` says fits (``floor``: none), from ``first``: each next depth where the line
    through the two probed depths nearest the budget crosses it (``lowest``: each probed depth's least peak, which
    ``probe`` fills), bisecting where that depth was probed already."""
    lo, hi, n = floor, MAX_BLOCKS + 1, first  # lo fits (floor: nothing yet), hi does not
    while hi - lo > 1:
        n = min(max(n, lo + 1), hi - 1)
        if n in lowest:
            n = (lo + hi) // 2
        if probe(n):
            lo = n
        else:
            hi = n
        n = _secant(lowest, budget)
    return lo


def first_guess(base: ModelConfig, budget: int, optim: OptimConfig, host_budget: int | None, split: int) -> int:
    """The depth whose parameters, gradients and moments alone would fill the budget, or offloaded, the host's (an
    upper bound)."""
    if optim.offload:  # on the card: the weights, and their gradients unless each is freed once copied out
        per_param = 4 if optim.in_backward else 8
    else:
        weight = 2 if base.weights_dtype == "bf16" else 4  # and as much for its gradient
        moments = {"adamw": 4 if optim.state_dtype == "bf16" else 8, "adamw8bit": 2, "adamw4bit": 1, "muon": 4}
        per_param = 2 * weight + moments.get(optim.name, 0)  # Adafactor, GaLore, APOLLO: a fraction of a byte
        per_param -= weight if optim.in_backward else 0
    lo, hi = 1, MAX_BLOCKS
    while lo < hi:
        mid = (lo + hi + 1) // 2
        n = param_count(OwnModel(scaled(base, mid, split)))
        if n * per_param <= budget and (not optim.offload or host_budget is None or 16 * n <= host_budget):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _secant(peaks: dict[int, int], budget: int) -> int:
    """The depth where the peak crosses the budget, on the line through the two profiled depths nearest to it (the
    peak grows about as the cube of the depth: fitted in the cube root)."""
    pts = sorted(peaks.items(), key=lambda kv: abs(kv[1] - budget))[:2]
    if len(pts) < 2:
        ((n, peak),) = pts
        return max(1, int(n * (budget / peak) ** (1 / 3)))
    (n1, p1), (n2, p2) = pts
    c1, c2, cb = p1 ** (1 / 3), p2 ** (1 / 3), budget ** (1 / 3)
    if c1 == c2:
        return n1 + (1 if p1 < budget else -1)
    return max(1, int(n1 + (cb - c1) * (n2 - n1) / (c2 - c1)))
