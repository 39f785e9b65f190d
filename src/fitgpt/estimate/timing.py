"""How long a plan's step takes: a cost per aten op, summed over the segments ``profile_step`` cuts.

The planner's profiles run every op of a step at its real size (on fake tensors): costing each op and
summing per segment gives each block option, head option, the embedding and the optimizer step
their time, and a plan's step time is the sum of its segments. Where the per-op costs come from:

- ``calibrate`` (measured, the device at hand): a small real training step of a one-block copy of the
  model, run twice at two token counts, every op timed as it runs (a CPU op returns when done; on CUDA
  each op is synchronised). Each op type gets a fixed cost and a rate, fitted through the two sizes:
  seconds per FLOP for ops with a FLOP formula (matmuls, attention), per byte moved for the rest
  (norms, GELU, dropout, residual adds, copies, AdamW's). The wall time the ops do not account for
  (Python, autograd, the dispatcher) is spread over the ops as a fixed cost each: recompute pays it
  too. Interleaved repeats, medians.
- ``roofline`` (estimated, a CUDA card not at hand; `fitgpt.estimate.roofline`): each op at the card's datasheet
  figures. An offloaded optimizer's own step on the host is timed apart (``host_seconds_per_byte``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode

from fitgpt.activation_checkpoint import apply_activation_checkpointing, remove_activation_checkpointing
from fitgpt.config import OptimConfig
from fitgpt.device import autocast
from fitgpt.estimate.roofline import is_counted, is_free, moved_bytes
from fitgpt.estimate.source import Float8Model, ModelSource, OwnModel, as_source, param_count
from fitgpt.memory.flops import OpFlops, op_flops
from fitgpt.model import ModelConfig
from fitgpt.optim import build_optimizer
from fitgpt.step import grad_scaler, train_step

log = logging.getLogger(__name__)

CALIBRATION_FLOPS = 8e9
"""FLOPs of the smaller calibration step (the larger has twice the tokens): a few hundredths of a second on a
laptop core, so that ops run at sizes near the real step's without calibration costing more than the plan."""
CALIBRATION_SECONDS = 2.0
"""About how long calibration repeats its rounds for."""
CALIBRATION_VOCAB = 2048
"""The calibration model's vocabulary at most: the head's matmul is costed at the rate of every matmul, and a
50k vocabulary would make calibration cost more than the plan."""
CALIBRATION_PARAMS = 2**25
"""The calibration model's parameters at most (with its gradients and AdamW state, about 0.5 GB): a wider model's
block is timed on a narrower proxy of it."""


def op_key(func) -> str:
    return str(func._overloadpacket)


def op_work(func, args: tuple, kwargs: dict, out, flops: int) -> tuple[str, int]:
    """What an op's time scales with: ("flops", n) where it has a FLOP formula, else ("bytes", n)."""
    if flops:
        return "flops", flops
    return "bytes", 0 if is_free(func) else moved_bytes(args, kwargs, out)


@dataclass
class OpRates:
    """Seconds of an op of each type: ``fixed + per_unit * work`` (work in FLOPs or bytes, see ``op_work``),
    plus ``overhead`` per op for what runs around the kernels."""

    fixed: dict[str, float] = field(default_factory=dict)
    per_unit: dict[str, float] = field(default_factory=dict)
    default_per_flop: float = 0.0
    default_per_byte: float = 0.0
    default_fixed: float = 0.0
    overhead: float = 0.0
    recompute_overhead: dict[str, float] = field(default_factory=dict)
    """Per recompute option, seconds per block and step beyond its ops (the checkpoint machinery's Python)."""
    source: str = ""
    """How the rates were obtained, for the output: measured on a device, or a roofline estimate."""

    def __call__(self, func, args: tuple, kwargs: dict, out, flops: int) -> float:
        if not is_counted(func):
            return 0.0
        kind, work = op_work(func, args, kwargs, out, flops)
        key = op_key(func)
        if key in self.per_unit:
            return self.overhead + self.fixed[key] + self.per_unit[key] * work
        rate = self.default_per_flop if kind == "flops" else self.default_per_byte
        return self.overhead + (self.default_fixed if work else 0.0) + rate * work


@functools.cache
def host_seconds_per_byte() -> float:
    """This machine's CPU stepping AdamW in its own memory, as an offloaded optimizer's host does (torch's fused CPU
    AdamW): seconds per byte read or written, the best of three steps over 2^23 parameters (128 MB
    held, more than a CPU's caches).
    Measured, not assumed: plan on the machine the card is in and it is that host's."""
    with unset_fake_temporarily():
        p = torch.zeros(1 << 23, requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW([p], fused=True)
        opt.step()  # the state
        best = min(timed(opt.step, torch.device("cpu")) for _ in range(3))
    return best / (7 * p.nbytes)  # weight, both moments read and written; the gradient read


class _OpTimer(TorchDispatchMode):
    """Times every op as it runs: (key, kind, work, seconds) per op."""

    def __init__(self, sync) -> None:
        super().__init__()
        self.sync, self.ops = sync, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.sync()
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.sync()
        dt = time.perf_counter() - t0
        kind, work = op_work(func, args, kwargs, out, op_flops(func, args, kwargs, out))
        self.ops.append((op_key(func), kind, work, dt))
        return out


def _median_run(runs: list[list]) -> list[tuple[str, str, int, float]]:
    """The median step as one run of (key, kind, work, seconds): an op is the n-th of its key and size in a step, its
    seconds the median over the repeats that ran it, and it is kept where at least half the repeats ran it. An
    optimizer whose step branches on the data (APOLLO's norm limiter, a skipped refresh) runs other ops from one
    repeat to the next: the step it takes most often is the one costed."""
    seen: dict[tuple[str, str, int, int], list[float]] = {}
    for run in runs:
        nth: dict[tuple[str, str, int], int] = defaultdict(int)
        for key, kind, work, seconds in run:
            nth[key, kind, work] += 1
            seen.setdefault((key, kind, work, nth[key, kind, work]), []).append(seconds)
    return [(key, kind, work, statistics.median(s)) for (key, kind, work, _), s in seen.items() if 2 * len(s) >= len(runs)]


def _line(points: list[tuple[int, float]], pooled: float, big: int) -> tuple[float, float]:
    """(fixed, per_unit) of seconds = fixed + per_unit * work for one op type, neither negative: least squares
    where its work varies and some of it is large; small ops (scalars, norms' statistics) take the pooled rate
    of their kind, their time beyond it fixed; one large size of work is all rate."""
    n = len(points)
    mw, ms = sum(w for w, _ in points) / n, sum(s for _, s in points) / n
    if max(w for w, _ in points) < big:
        return max(0.0, ms - pooled * mw), pooled
    var = sum((w - mw) ** 2 for w, _ in points)
    if var == 0:
        return 0.0, ms / mw
    per_unit = max(0.0, sum((w - mw) * (s - ms) for w, s in points) / var)
    return max(0.0, ms - per_unit * mw), per_unit


BIG = {"flops": 1 << 20, "bytes": 1 << 16}
"""Work above which an op's time is mostly its rate, not its fixed cost: what rates are fitted on."""


def _fit_rates(runs: list[list[list]], walls: list[float]) -> OpRates:
    """Per op type, ``fixed + per_unit * work`` through every op of that type at both sizes (medians over
    repeats); the wall time the ops leave unexplained becomes a cost per op."""
    ops = [_median_run(r) for r in runs]
    points, kinds = defaultdict(list), {}
    for run in ops:
        for key, kind, w, dt in run:
            points[key].append((w, dt))
            kinds[key] = kind
    rates = OpRates()
    pooled = {}
    for kind in BIG:
        large = [p for key, pp in points.items() if kinds[key] == kind for p in pp if p[0] >= BIG[kind]]
        pooled[kind] = sum(s for _, s in large) / sum(w for w, _ in large) if large else 0.0
    rates.default_per_flop, rates.default_per_byte = pooled["flops"], pooled["bytes"]
    for key, pts in points.items():
        rates.fixed[key], rates.per_unit[key] = _line(pts, pooled[kinds[key]], BIG[kinds[key]])
    rates.default_fixed = statistics.median(rates.fixed.values()) if rates.fixed else 0.0
    # Per op: the plain run's wall time less what the timed run's ops explain (at the larger size).
    rates.overhead = max(0.0, (statistics.median(walls) - sum(o[3] for o in ops[1])) / len(ops[1]))
    return rates


def _calibration_shape(source: ModelSource, batch: int, context: int) -> tuple[int, int]:
    """(batch, context) of the smaller calibration step: about CALIBRATION_FLOPS, at most half the real step's
    tokens, at least 64 tokens (or the real step's)."""
    with torch.device("meta"):
        model = _small(source).build()
    # The matmuls of a block and the head, forward and backward (2 + 4 FLOPs a weight a token).
    per_token = 6 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    tokens = max(min(64, batch * context), min(int(CALIBRATION_FLOPS / per_token), batch * context // 2))
    c = min(context, tokens)
    return max(1, tokens // c), c


RECOMPUTE_SPECS = {"pointwise": "pointwise", "selective": "selective", "block": "block", "torchtitan": "torchtitan"}
"""Each recompute option of a block, as the policy that applies it to every block."""


def _small(source: ModelSource, context: int | None = None, vocab: int = CALIBRATION_VOCAB) -> ModelSource:
    """One block of ``source`` with a small vocabulary: the ops of every block, timed in a fraction of the step
    (a model that cannot be resized is timed whole); fitgpt's own, narrowed where one block is too large to time in
    bounded memory (`_narrowed`)."""
    if not source.resizable:
        return source
    return _narrowed(source.at(n_blocks=1, context=context, vocab_size=min(source.vocab_size, vocab)))


def _narrowed(block: ModelSource) -> ModelSource:
    """A one-block model of fitgpt's over CALIBRATION_PARAMS parameters, as a narrower proxy: the same head size, MLP
    ratio and key/value grouping, fewer heads. The rates fitted on it are per FLOP and per byte, so they cost the
    real block's ops; timing the real one would hold 16 bytes a parameter (8192 wide: 13 GB) for a minute."""
    if isinstance(block, Float8Model):
        return Float8Model(_narrowed(block.inner), block.recipe)
    if not isinstance(block, OwnModel) or (params := param_count(block)) <= CALIBRATION_PARAMS:
        return block
    m = block.cfg
    group = m.n_head // m.kv_heads if m.n_kv_head else 1  # query heads per key/value head, kept

    def with_heads(heads: int) -> OwnModel:
        width = heads * m.head_dim
        ffn = -(-m.mlp_hidden * width // m.n_embed // 64) * 64 if m.ffn_hidden else None
        return OwnModel(dataclasses.replace(m, n_embed=width, n_head=heads, n_kv_head=heads // group if m.n_kv_head else None,
                                            ffn_hidden=ffn))

    heads = max(group, int(m.n_head * math.sqrt(CALIBRATION_PARAMS / params)) // group * group)
    while heads > group and param_count(with_heads(heads)) > CALIBRATION_PARAMS:  # the embeddings grow linearly
        heads -= group
    return with_heads(heads)


def calibrate(model: ModelConfig | ModelSource, batch: int, context: int, device: torch.device, dtype: torch.dtype | None,
              optim_cfg: OptimConfig | None = None, seconds: float = CALIBRATION_SECONDS, seed: int = 0) -> OpRates:
    """Per-op costs measured on ``device`` for steps of ``batch`` x ``context``: a one-block model's training
    step (forward, backward, optimizer) at two token counts, each op timed; see the module's docstring. Rounds
    repeat for about ``seconds`` (2 to 25 of them): medians of many short steps, or of a few long ones."""
    t0 = time.perf_counter()
    model = as_source(model)
    b, c = _calibration_shape(model, batch, context)
    small = _small(model, context=c)
    torch.manual_seed(seed)
    net = small.build().to(device).train()
    optim_cfg = optim_cfg or OptimConfig()
    optimizer = build_optimizer(net, optim_cfg, device)
    kw = {"amp": autocast(device, dtype), "scaler": grad_scaler(device, dtype), "grad_clip": optim_cfg.grad_clip}
    sizes = [token_batches(small.vocab_size, 1, rows, c, device, seed) for rows in (b, 2 * b)]
    sync = _sync(device)

    def step(batches) -> float:
        return timed(lambda: train_step(net, optimizer, batches, **kw), device)

    for batches in sizes:  # warm-up: the optimizer state exists from here on, as in training
        step(batches)
    op_runs: list[list[list]] = [[], []]
    walls: list[float] = []
    rounds = 0
    while rounds < 2 or (rounds < 25 and time.perf_counter() - t0 < seconds):  # interleaved: noise falls on all alike
        rounds += 1
        for i, batches in enumerate(sizes):
            with _OpTimer(sync) as timer:
                step(batches)
            op_runs[i].append(timer.ops)
        walls.append(step(sizes[1]))
    rates = _fit_rates(op_runs, walls)
    rates.recompute_overhead = _machinery(model, device, dtype, rates, seed)
    real, timed_on = _width(model), _width(small)
    proxy = f", a proxy {timed_on} wide for the model's {real}: rates per FLOP and per byte" if timed_on != real else ""
    rates.source = (f"measured on {device} (ops of a one-block step at {b * c} and {2 * b * c} tokens{proxy}, medians of "
                    f"{rounds} interleaved rounds; {time.perf_counter() - t0:.1f}s)")
    log.debug("calibrated op costs: %s; %.1f us overhead per op; recompute machinery per block %s", rates.source,
              rates.overhead * 1e6, {k: f"{v * 1e3:.2f} ms" for k, v in rates.recompute_overhead.items()})
    return rates


def _width(source: ModelSource) -> int | None:
    return source.cfg.n_embed if isinstance(source, OwnModel) else None


def _sync(device: torch.device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of ``fn()`` on ``device`` (CUDA's queue drained before and after)."""
    sync = _sync(device)
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def token_batches(vocab_size: int, micro_batches: int, rows: int, context: int, device: torch.device,
                  seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded random (inputs, targets) micro-batches, each (rows, context): a step's data for timing it."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (micro_batches, rows, context + 1), generator=g).to(device)
    return [(idx[i, :, :-1].contiguous(), idx[i, :, 1:].contiguous()) for i in range(micro_batches)]


MACHINERY_SECONDS, MACHINERY_TOKENS = 0.5, 16


def _machinery(source: ModelSource, device: torch.device, dtype: torch.dtype | None, rates: OpRates,
               seed: int) -> dict[str, float]:
    """Per recompute option, the seconds a block's forward and backward take beyond what its ops cost: the
    checkpoint machinery (saved-tensor hooks, the op-level policies' dispatch mode), Python whose cost does not
    grow with the tokens. Measured on one block at MACHINERY_TOKENS tokens, where the ops cost next to nothing
    and many interleaved rounds fit in MACHINERY_SECONDS: the wall time each option adds over none, less what
    its extra ops cost by ``rates``."""
    small = _small(source, context=MACHINERY_TOKENS, vocab=256)
    torch.manual_seed(seed)
    model = small.build().to(device).train()
    (x, y), = token_batches(small.vocab_size, 1, 1, MACHINERY_TOKENS, device, seed)
    amp = autocast(device, dtype)

    def fwd_bwd() -> None:
        with amp():
            loss = model(x, y)[1]
        loss.backward()
        model.zero_grad(set_to_none=True)

    specs = {"none": None, **RECOMPUTE_SPECS}
    walls: dict[str, list[float]] = {o: [] for o in specs}
    costs: dict[str, float] = {}
    t0 = time.perf_counter()
    while len(walls["none"]) < 5 or (len(walls["none"]) < 50 and time.perf_counter() - t0 < MACHINERY_SECONDS):
        for option, spec in specs.items():
            if spec:
                apply_activation_checkpointing(model, spec)
            if option not in costs:
                fwd_bwd()  # warm-up, and the ops' cost by the rates
                with OpFlops(rates) as costed:
                    fwd_bwd()
                costs[option] = costed.seconds
            walls[option].append(timed(fwd_bwd, device))
            remove_activation_checkpointing(model)
    base = statistics.median(walls["none"]) - costs["none"]
    return {o: max(0.0, statistics.median(walls[o]) - costs[o] - base) for o in RECOMPUTE_SPECS}
