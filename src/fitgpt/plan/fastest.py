"""The fastest whole configuration that fits: ``fitgpt fit`` prints it, ``fitgpt train --auto-config`` trains with it.

For a fixed number of sequences per step and rank (``--batch-size`` x ``--grad-accum``): every split into a
micro-batch and accumulation, each precision the target trains in, and with ``--world-size`` DDP, FSDP and each
tensor-parallel degree within a node (alone, or with FSDP over the groups); on
CUDA also FSDP2's CPU offload of parameters, gradients and optimizer state (``CPUOffloadPolicy``) where the
weights and optimizer state leave no room otherwise (FSDP shards across processes: the trainer runs it under
torchrun with two or more, so one process is offered neither). Each gets the fastest checkpointing plan that fits (the
solver), and all are ranked by predicted tokens per second.

Bytes are the planner's: micro-batches are fitted through two exact profiles (bytes are affine in the batch),
and every configuration shown is settled on a profile of its own size. Compute time is the profile's time
model; what crosses links (DDP's all-reduce, FSDP's gathers, the offload's copies and its CPU optimizer step)
is estimated from link bandwidths and named as an estimate.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from fitgpt.command import ranks_per_node, train_command
from fitgpt.config import TrainConfig
from fitgpt.device import resolve_device
from fitgpt.errors import UserError
from fitgpt.estimate.profile import StepProfile, named_options
from fitgpt.estimate.source import param_count
from fitgpt.estimate.workload import Workload, workload_for
from fitgpt.plan.extrapolate import extrapolate
from fitgpt.plan.solver import Plan, PlanError, Prediction, predict, solve
from fitgpt.refusals import launch_refusal
from fitgpt.units import format_bytes, parse_bytes
from fitgpt.utils import in_processes

log = logging.getLogger(__name__)

GLOO_LINK, HOST_BANDWIDTH = 5e9, 20e9
"""Assumed: bytes/s between CPU processes (gloo over loopback), and host memory bandwidth for an offloaded
optimizer step on the CPU."""


@dataclass(frozen=True)
class Layout:
    parallel: str
    """single, ddp, fsdp, tp (tensor parallelism alone, every rank one group's), or pp (a pipeline alone)."""
    offload: bool = False
    tp: int = 1
    """The tensor-parallel degree (above 1 under fsdp: FSDP over world / tp groups of tp)."""
    pp: int = 1
    """The pipeline's stages' ranks (above 1 under fsdp: each stage sharded over world / pp ranks)."""
    schedule: str = "1f1b"
    microbatches: int = 0
    """With ``pp``: the schedule, and the micro-batches it cuts a step's batch into."""

    @property
    def name(self) -> str:
        if self.pp > 1:
            return f"pp{self.pp} {self.schedule} ({self.microbatches} mb)" + (" x fsdp" if self.parallel == "fsdp" else "")
        if self.parallel == "tp":
            return f"tp{self.tp}"
        return self.parallel + ("+offload" if self.offload else "") + (f" x tp{self.tp}" if self.tp > 1 else "")

    @property
    def trains_as(self) -> str:
        """--parallel for this layout (one process, a tensor-parallel group or a pipeline alone: ddp's default, no
        wrapper)."""
        return "ddp" if self.parallel in ("single", "tp", "pp") else self.parallel

    def settings(self) -> dict:
        """The training config's fields this layout sets."""
        return dict(parallel=self.trains_as, fsdp_offload=self.offload, tensor_parallel=self.tp,
                    pipeline_parallel=self.pp, pipeline_schedule=self.schedule, pipeline_microbatches=self.microbatches)


@dataclass(frozen=True)
class Choice:
    micro_batch: int
    grad_accum: int
    precision: str
    layout: Layout
    plan: Plan
    peak: int
    compute_seconds: float
    link_seconds: float
    """Communication and offload time not hidden behind compute (estimated)."""
    tokens: int
    """Tokens per step, all data-parallel ranks (a tensor-parallel group's ranks train one batch)."""
    settled: bool
    """Its bytes from a profile of its own micro-batch (not fitted between two)."""
    given: str = ""
    """The policy as the user gave it, where one was (``plan`` is its nearest profiled plan)."""

    @property
    def policy(self) -> str:
        return self.given or self.plan.spec()

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.link_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_seconds

    def config(self, base: TrainConfig) -> TrainConfig:
        """``base`` with this choice written into it: what trains it."""
        return dataclasses.replace(base, batch_size=self.micro_batch, grad_accum=self.grad_accum, precision=self.precision,
                                   activation_checkpointing=self.policy, **self.layout.settings())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _precisions(w: Workload) -> list[str]:
    """What the target trains in: on CUDA its half precision and fp32; on CPU fp32 and bf16."""
    t = w.target
    if w.train.precision != "auto":
        return [w.train.precision]
    if t.cuda:
        half = "bf16" if t.sm >= (8, 0) else "fp16"
        # A step inside the backward cannot wait for fp16's loss scaler, nor reach a step on the host (the config
        # refuses both).
        o = w.train.optim
        return ["fp32"] if half == "fp16" and (o.in_backward or o.offload) else [half, "fp32"]
    return ["fp32", "bf16"]


def _layouts(w: Workload) -> list[Layout]:
    """The layouts the trainer would launch (`refusals.launch_refusal`, the trainer's own refusals)."""
    if w.world_size == 1:  # FSDP (and its offload) shards across processes: the trainer runs it under torchrun, N >= 2
        return [Layout("single")]
    offered = [Layout("ddp"), Layout("fsdp")] + ([Layout("fsdp", True)] if w.target.cuda else []) + _tensor_parallel(w)
    return [layout for layout in offered if layout_refusal(w, layout) is None]


def layout_refusal(w: Workload, layout: Layout) -> str | None:
    """Why the trainer would refuse ``w`` under ``layout`` (None: it trains); fit names the plan it solves."""
    try:
        cfg = dataclasses.replace(w.train, activation_checkpointing="none", **layout.settings())
        if layout.pp > 1:  # a pipeline's step is its whole batch, cut by the schedule
            cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size * cfg.grad_accum, grad_accum=1)
    except UserError as e:  # a combination the config refuses (FSDP's offload with pure bf16 weights)
        return str(e)
    return launch_refusal(cfg, w.world_size, w.target.device, None, planned=w.fake)


def _tensor_parallel(w: Workload) -> list[Layout]:
    """Each tensor-parallel degree within a node (its GPUs: the fast links): alone where it spans every rank, else
    with FSDP over the groups."""
    if w.source is not None:  # a model of fitgpt's own
        return []
    per_node = ranks_per_node(w.world_size)
    return [Layout("tp" if tp == w.world_size else "fsdp", tp=tp) for tp in _divisors(per_node) if tp > 1]


def _offloaded(p: StepProfile, params: int, world: int) -> StepProfile:
    """One rank's FSDP profile with parameters, gradients and optimizer state in host memory (modelled): the device
    keeps what the ranks gather while a module runs (the root's weights from its forward to its backward, a block's
    while it runs: in the profiled segments, as under FSDP) and no shard, gradient or moment between them."""
    # AdamW on the host reads parameter, gradient and both moments (16 B, fp32) and writes three of them (12 B).
    return dataclasses.replace(p, params=0, optimizer=0, grads=0, baseline=0, optimizer_rise=0,
                               block_grads=[0] * p.n_blocks, optimizer_time=28 * params / world / HOST_BANDWIDTH)


def _link_seconds(w: Workload, layout: Layout, accum: int, micro: float, params: int, dtype_bytes: int,
                  rows: int) -> float:
    """Estimated seconds of communication and offload traffic not overlapped with compute (``micro``: a
    micro-batch's compute seconds; ``rows``: its sequences)."""
    t, tp = w.target, layout.tp
    n = w.world_size // tp  # the data-parallel ranks
    gpu = t.gpu
    peer = (gpu.peer_link if gpu else 32e9) if t.cuda else GLOO_LINK
    share = (n - 1) / n
    params //= tp  # a rank's split of the model: what FSDP gathers and reduces
    seconds = 0.0
    if tp > 1:  # on the critical path: each block's 2 all-gathers and 2 reduce-scatters forward, as many backward
        m = w.train.model  # tensor parallelism splits fitgpt's own model only
        activation = rows * w.context * m.n_embed * dtype_bytes
        seconds += 8 * m.n_blocks * (tp - 1) / tp * activation * accum / peer
    if layout.parallel == "ddp":  # one all-reduce of fp32 gradients a step, overlapped with the last backward
        seconds += max(0.0, 2 * share * 4 * params / peer - micro * 2 / 3)
    elif layout.parallel == "fsdp" and n > 1:  # every micro-batch: gathers (forward, backward), an fp32 reduce-scatter
        traffic = share * params * accum * (2 * dtype_bytes + 4)
        seconds += max(0.0, traffic / peer - accum * micro)
    if layout.offload:  # every micro-batch: the shard in (forward and backward), its reduced gradients out
        pcie = gpu.pcie if gpu else 32e9
        seconds += 3 * accum * 4 * params / n / pcie
    return seconds


def fastest(w: Workload, budget: int, top: int = 5, policy: str = "auto", workers: int | None = None,
            pipelines: Callable | None = None) -> dict:
    """Every configuration that fits ``budget`` (see the module's docstring), fastest first, ``top`` of them
    settled on their own profiles. ``policy``: auto solves each configuration's plan; another is kept as given.
    Each precision and layout is an independent search, single-threaded on fake tensors: they run in ``workers``
    processes (default: one per CPU core, at most one per search). ``pipelines``: the pipeline layouts' search
    (`fitgpt.plan.pipeline.pipeline_choices`: every rank planned, so weighed only where asked)."""
    given = None if policy == "auto" else policy
    seqs = w.train.batch_size * w.train.grad_accum
    precisions = _precisions(w)
    # One time model per autocast dtype, made (or measured) here, before any search runs beside it.
    search = _Search(w, budget, given, named_options(policy), param_count(w.model), seqs * w.context * w.world_size,
                     {p: w.vary(precision=p).cost for p in precisions})
    found: list[Choice] = []
    profiles = 0
    for offload in (False, True):  # offload only where nothing fits without it (its copies cost time)
        jobs = [(search, seqs, precision, layout, not w.train.optim.in_backward)
                for precision in precisions for layout in _layouts(w) if layout.offload == offload]
        for choices, n in in_processes(_family, jobs, workers):
            found += choices
            profiles += n
        if pipelines is not None and not offload:
            choices, n = pipelines(search, seqs, precisions)
            found += choices
            profiles += n
        if found:
            break
    found.sort(key=lambda c: -c.tokens_per_s)
    settled: list[Choice] = []
    for c in found:  # settle the leaders on profiles of their own size; one that no longer fits drops out
        if len(settled) >= top:
            break
        if not c.settled:
            profiles += 1
            c = search.choose(search.exact(c.precision, c.layout, c.micro_batch, c.grad_accum), c.precision, c.layout,
                              c.micro_batch, c.grad_accum, True)
        if c is not None:
            settled.append(c)
    settled.sort(key=lambda c: -c.tokens_per_s)
    return {"workload": w.describe(), "budget": budget, "tokens_per_step": search.tokens, "choices": settled,
            "considered": len(found), "profiles": profiles,
            "time_models": {precision: getattr(c, "source", "") for precision, c in search.costs.items()},
            "note": f"{len(found)} configurations fit {format_bytes(budget)} of those searched; the {len(settled)} fastest, "
                    f"each settled on a profile of its own micro-batch ({profiles} profiles in all)"}


@dataclass(frozen=True)
class _Search:
    """What every configuration of one ``fastest`` search is profiled and chosen against."""

    w: Workload
    budget: int
    given: str | None
    named: tuple[str, ...]
    params: int
    tokens: int
    """Tokens per step, all ranks."""
    costs: dict
    """The time model of each precision searched."""

    def exact(self, precision: str, layout: Layout, micro: int, accum: int) -> StepProfile:
        w = self.w.vary(precision=precision, parallel=layout.trains_as, batch_size=micro, grad_accum=min(accum, 2),
                        cost=self.costs[precision], tensor_parallel=layout.tp)
        p = w.profile(extra_options=self.named)
        return _offloaded(p, self.params, self.w.world_size) if layout.offload else p

    def choose(self, p: StepProfile, precision: str, layout: Layout, micro: int, accum: int, settled: bool) -> Choice | None:
        p = dataclasses.replace(p, grad_accum=accum)
        try:
            plan, pred = solve(p, self.budget) if self.given is None else _as_given(p, self.given, self.budget)
        except PlanError:
            return None
        micro_s = (pred.step_time - p.optimizer_time) / accum
        link = _link_seconds(self.w, layout, accum, micro_s, self.params, 2 if precision in ("bf16", "fp16") else 4,
                             micro)
        return Choice(micro, accum, precision, layout, plan, pred.peak, pred.step_time, link, self.tokens // layout.tp,
                      settled, self.given or "")


def _as_given(p: StepProfile, policy: str, budget: int) -> tuple[Plan, Prediction]:
    """The policy as given (its nearest profiled plan) and its prediction; PlanError if it does not fit."""
    plan, _ = Plan.profiled(policy, p)
    pred = predict(p, plan)
    if pred.peak > budget:
        raise PlanError(f"{policy} does not fit")
    return plan, pred


def _family(search: _Search, seqs: int, precision: str, layout: Layout, accumulate: bool = True) -> tuple[list[Choice], int]:
    """Every micro-batch of one precision and layout, and the profiles taken: micro-batches below the whole step
    accumulate (gradients held between micro-batches), fitted through exact profiles at the two largest of them; the
    whole step at once is profiled as it is. ``accumulate=False``: the whole step only (an optimizer that steps in
    the backward)."""
    out = []
    micro = _divisors(seqs)
    whole = search.choose(search.exact(precision, layout, seqs, 1), precision, layout, seqs, 1, True)
    out += [whole] if whole else []
    accumulating = micro[:-1] if accumulate else []
    if not accumulating:
        return out, 1
    points = [(m, search.exact(precision, layout, m, seqs // m)) for m in accumulating[-2:]]
    for m in accumulating:
        p = dict(points).get(m) or extrapolate(points, m, "batch_size")
        c = search.choose(p, precision, layout, m, seqs // m, m in dict(points))
        if c:
            out.append(c)
    return out, 1 + len(points)


def format_choices(result: dict, w: Workload) -> str:
    kinds = [text for text, on in (
        ("under tensor parallelism of degree t, 1/t of them: a group's ranks train one batch",
         any(c.layout.tp > 1 for c in result["choices"])),
        ("under a pipeline of p ranks, 1/p of them: its stages' ranks train one batch",
         any(c.layout.pp > 1 for c in result["choices"]))) if on]
    split = f" ({'; '.join(kinds)})" if kinds else ""
    lines = [f"{result['workload']}; budget {format_bytes(result['budget'])}; {result['tokens_per_step']:,} tokens a step"
             f"{split}",
             "", "| # | micro-batch x accum | precision | parallel | checkpointing | predicted peak | step (ms) | tokens/s | "
             "of which links (ms) |", "|---:|---|---|---|---|---:|---:|---:|---:|"]
    for i, c in enumerate(result["choices"], 1):
        lines.append(f"| {i} | {c.micro_batch} x {c.grad_accum} | {c.precision} | {c.layout.name} | `{c.policy}` | "
                     f"{format_bytes(c.peak)} | {c.step_seconds * 1e3:.0f} | {c.tokens_per_s:,.0f} | {c.link_seconds * 1e3:.0f} |")
    models = "; ".join(f"{p}: {source}" for p, source in result["time_models"].items())
    lines.append(f"\n({result['note']}; time models: {models}"
                 + ("; links estimated from bandwidths" if any(c.link_seconds for c in result["choices"]) else "") + ")")
    if result["choices"]:
        best = result["choices"][0].config(w.train)
        lines.append(f"train the fastest: {train_command(best, w.world_size)}" if w.source is None
                     else f"the fastest, {w.how_to_train(best)}")
    return "\n".join(lines)


def for_training(cfg: TrainConfig) -> tuple[TrainConfig, Choice, dict]:
    """``fitgpt train --auto-config``: the fastest configuration for ``cfg``'s tokens a step within its
    --memory-budget, on the device it trains on (fake tensors on CPU; measured on an accelerator), as the
    training config to run (every choice written into it, so config.json records what ran)."""
    w = workload_for(cfg, device=resolve_device(cfg.device))
    given = cfg.activation_checkpointing  # a policy named is kept; none (the default) or auto is planned
    result = fastest(w, w.target.tensor_budget(parse_bytes(cfg.memory_budget)), top=1,
                     policy="auto" if given in ("none", "auto") else given)
    if not result["choices"]:
        raise PlanError(f"no configuration of {result['tokens_per_step']:,} tokens a step fits --memory-budget "
                        f"{cfg.memory_budget}; fitgpt fit --memory-budget {cfg.memory_budget} says what does")
    c = result["choices"][0]
    chosen = dataclasses.replace(c.config(cfg), memory_budget=None, auto_config=False)
    return chosen, c, result
