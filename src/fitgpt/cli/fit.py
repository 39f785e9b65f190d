"""`fitgpt fit --memory-budget 6GiB`: the largest batch, context and depth that fit, per policy; with
--largest-model, the largest model of the preset's shape under each optimizer memory setting."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fitgpt.cli.workload import BudgetConfig, parse_workload
from fitgpt.command import train_command
from fitgpt.config import load_config
from fitgpt.data.config import DataConfig
from fitgpt.errors import UserError, require_not_empty
from fitgpt.estimate.roofline import roofline
from fitgpt.memory.picture import draw
from fitgpt.plan.family import LADDER_SETTINGS, LOSS_COST, largest_model
from fitgpt.plan.family_pipeline import largest_pipelined
from fitgpt.plan.fastest import fastest, format_choices
from fitgpt.plan.largest import largest
from fitgpt.plan.pipeline import pipeline_choices
from fitgpt.plan.solver import solve
from fitgpt.units import format_bytes, format_count, parse_duration
from fitgpt.utils import host_memory, outputs_apart, writable_dir


@dataclass
class FitConfig(BudgetConfig):
    """How large a batch, context or model fits in a budget, without and with checkpointing; and the fastest
    configuration (micro-batch x accumulation, precision, DDP/FSDP, checkpointing plan) that fits."""

    top: int = 5
    """How many of the fastest configurations to show."""
    activation_checkpointing: str = "auto"
    """As for fitgpt train: auto plans each configuration; a policy (block, selective, torchtitan, ...) is kept as
    given, in the fastest configurations and as a column of the largest sizes."""
    report: Optional[str] = None
    """Write the picture of where the memory goes into this folder: fit.png, the fastest configuration's step beside
    none at its settings, on one scale (as fitgpt plan --report draws a plan)."""
    time_budget: Optional[str] = None
    """Instead: which model this much training time buys, e.g. 4m, 7d: for each depth of one family of shapes (width
    64 a block), its fastest configuration that fits, the tokens it trains in the time, and the loss the law
    predicts; the pick is the least. Default --memory-budget on this machine: its memory."""
    law: Optional[str] = None
    """With --time-budget: a law file written by fitgpt ladder on this data (default: Hoffmann et al.'s published
    coefficients, fitted on another corpus and tokenizer, and said so on every line that uses them)."""
    data: DataConfig = None  # filled from --preset and --config
    """With --time-budget, the data to train on, as fitgpt train takes it (--data.dir): its size counts the epochs,
    and its tokenizer must be the law's."""
    unique_tokens: Optional[float] = None
    """With --time-budget: the unique tokens the run will draw from, to count its repeats (default: the prepared
    data's train tokens); e.g. 1e12 to plan for a corpus larger than the data at hand."""
    search_pipeline: bool = False
    """Also weigh pipeline layouts among the fastest configurations (--world-size N): each pipeline degree dividing N
    (FSDP over the rest), each schedule, every rank planned on fake ranks (seconds a layout for a small model); with
    --largest-model, a row for each pipeline degree and optimizer setting its stages train."""
    largest_model: bool = False
    """Instead: the largest model of the preset's shape (its width per block, head size, MLP ratio, key/value heads)
    that trains at --batch-size x --context on one card (or each rank of --world-size N --parallel fsdp, with
    --tensor-parallel T within them), under each optimizer memory setting (AdamW; bf16 moments; the step in the
    backward; 8-bit AdamW; ...), each with its fastest checkpointing plan and its train command."""

    def __post_init__(self) -> None:
        require_not_empty(self, ("time_budget", "law"))
        self.data = self.data or load_config(self.preset, self.config).data
        if self.time_budget is not None:
            parse_duration(self.time_budget)
            if not (self.memory_budget or self.gpu):  # this machine's memory: what a run here may use
                self.memory_budget = f"{host_memory() // 2**20}MiB"
            if self.largest_model:
                raise UserError("--time-budget picks the model the time buys and --largest-model the largest that fits: "
                                "drop one of them")
        elif self.law or self.unique_tokens is not None:
            flag = "--law" if self.law else "--unique-tokens"
            raise UserError(f"{flag} is for the rows of --time-budget: add --time-budget, e.g. 4m")
        if self.unique_tokens is not None and not (self.unique_tokens >= 1 and math.isfinite(self.unique_tokens)):
            raise UserError(f"--unique-tokens must be a number of tokens, 1 or more, got {self.unique_tokens}")
        super().__post_init__()
        if self.top < 1:
            raise UserError("--top must be at least 1")
        if self.report:
            outputs_apart({"--config": self.config, "--hf-config": self.hf_config}, [("--report", Path(self.report) / "fit.png")])
            writable_dir(Path(self.report), "--report")
        if self.largest_model and self.hf_config:
            raise UserError("--largest-model scales fitgpt's own shapes (a preset or --model.*); a --hf-config model "
                            "is fixed by its config.json: drop one of them")
        if self.pipeline_parallel > 1:
            raise UserError(f"--pipeline-parallel {self.pipeline_parallel} is planned by fitgpt plan; fit searches the "
                            "pipeline's degree and schedule itself with --search-pipeline: drop --pipeline-parallel")
        if self.search_pipeline and ((self.world_size or 1) < 2 or self.time_budget):
            raise UserError("--search-pipeline weighs pipelines among the fastest configurations (or the largest "
                            "models) over --world-size N (2 or more) ranks: add --world-size, or drop --search-pipeline"
                            + (" (--time-budget does not search layouts)" if self.world_size > 1 else ""))
        if self.tensor_parallel > 1 and not self.largest_model:
            raise UserError(f"--tensor-parallel {self.tensor_parallel} is for --largest-model's rows; fit searches the "
                            "tensor-parallel degree itself among the fastest configurations: drop --tensor-parallel")
        if self.largest_model and (self.world_size or 1) > self.tensor_parallel and self.parallel != "fsdp":
            raise UserError("--largest-model over --world-size N answers for a model FSDP shards: add --parallel fsdp "
                            "(DDP's ranks each hold what one card does: drop --world-size)")
        if self.largest_model and self.activation_checkpointing != "auto":
            raise UserError("--largest-model plans each size's checkpointing itself: drop --activation-checkpointing")
        if self.largest_model:
            self._check_ladder()
        if self.activation_checkpointing != "auto":
            self.check_policy(self.activation_checkpointing)


    @property
    def weight_shards(self) -> int:
        """fit weighs FSDP and tensor parallelism over every rank of --world-size, whatever --parallel says."""
        return self.world_size or 1

    def _check_ladder(self) -> None:
        """--largest-model's rows are each an optimizer setting of their own: one given for all would bend every row
        and leave its label wrong."""
        base = self._base.optim
        for name in LADDER_SETTINGS:
            if getattr(self.optim, name) != getattr(base, name):
                flag = f"--optim.{name.replace('_', '-')}"
                raise UserError(f"--largest-model compares the optimizer memory settings itself, a row each (AdamW, bf16 "
                                f"moments, the step in the backward, 8-bit and 4-bit AdamW, Adafactor, APOLLO-Mini, on the "
                                f"host): drop {flag}")


def run(args: list[str]) -> int:
    cfg = parse_workload(FitConfig, args, "fitgpt fit")
    if cfg.largest_model:
        return _largest_model(cfg)
    if cfg.time_budget:
        from fitgpt.cli.fit_budget import time_budget

        return time_budget(cfg)
    _refuse_fixed_costs_over(cfg)
    result = largest(cfg.workload, cfg.budget, given=cfg.activation_checkpointing)
    a, cur, policies = result["answers"], result["current"], result["policies"]
    print(f"{result['workload']}; budget {format_bytes(result['budget'])}\n")
    print("| largest that fits | " + " | ".join(policies) + " | " + " | ".join(f"{p} vs none" for p in policies[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(policies) - 1))
    for key, label in (("batch_size", f"batch (at context {cur['context']})"), ("context", f"context (at batch {cur['batch_size']})"),
                       ("n_blocks", f"blocks (at batch {cur['batch_size']} x {cur['context']})")):
        vals = [a[p][key] for p in policies]
        ratios = [f"{v / vals[0]:.1f}x" if vals[0] else ("-" if not v else "fits only with it") for v in vals[1:]]
        print(f"| {label} | " + " | ".join(str(v) for v in vals) + " | " + " | ".join(ratios) + " |")
    print(f"\n({result['note']}; 0 means not even 1 fits)")
    best = fastest(cfg.workload, cfg.budget, top=cfg.top, policy=cfg.activation_checkpointing,
                   pipelines=pipeline_choices if cfg.search_pipeline else None)
    if not best["choices"] and not any(a[p][k] for p in policies for k in a[p]):
        say_why_nothing_fits(cfg)
    print("\nThe fastest configurations for the same tokens a step:\n")
    print(format_choices(best, cfg.workload))
    result["fastest"] = [{"micro_batch": c.micro_batch, "grad_accum": c.grad_accum, "precision": c.precision,
                          "parallel": c.layout.name, "tensor_parallel": c.layout.tp, "pipeline_parallel": c.layout.pp,
                          "pipeline_schedule": c.layout.schedule if c.layout.pp > 1 else None, "policy": c.policy,
                          "predicted_peak": c.peak,
                          "step_seconds": c.step_seconds, "link_seconds": c.link_seconds, "tokens_per_s": c.tokens_per_s}
                         for c in best["choices"]]
    if cfg.report and best["choices"]:
        _report(cfg, best["choices"][0])
    print(json.dumps(result))
    return 0


def say_why_nothing_fits(cfg: FitConfig) -> None:
    """Raises, saying what takes the memory and what to change, at batch 1: over --world-size ranks for a rank of the
    layout that holds the least (FSDP over all of them), so that the bytes are a rank's and the way out is more ranks,
    not the sharding the search already weighed."""
    solve(_bytes_at_batch_one(cfg), cfg.budget)


def _refuse_fixed_costs_over(cfg: FitConfig) -> None:
    """In one process the weights, gradients and optimizer state are the same in every configuration the search
    weighs: when they alone are over the budget (no step profiled to know it), say so, explained by a profile at batch 1,
    before searching for minutes."""
    if cfg.weight_shards > 1 or cfg.device:  # FSDP would shard them; a measured step is the search's own
        return
    fixed = cfg.workload_timed_by(roofline(None, None)).fixed_costs()  # no step profiled: a fraction of one's time
    if fixed["params"] + fixed["grads"] + fixed["optimizer"] >= cfg.budget:
        say_why_nothing_fits(cfg)


def _bytes_at_batch_one(cfg: FitConfig):
    """One rank's step at batch 1 (over --world-size ranks, under FSDP over all of them), bytes only: the time model
    (seconds of measuring) is left to the search, and a roofline stands in for it here."""
    w = cfg.workload_timed_by(roofline(None, None))
    return (w.vary(parallel="fsdp", tensor_parallel=1) if cfg.weight_shards > 1 else w).profile(batch_size=1)


def _report(cfg: FitConfig, choice) -> None:
    """fit.png: the fastest configuration's step (its micro-batch, accumulation, precision, parallelism and plan)
    beside none at the same settings."""
    train = choice.config(cfg.workload.train)
    w = cfg.workload.vary(batch_size=train.batch_size, grad_accum=train.grad_accum, precision=train.precision,
                          parallel=train.parallel, fsdp_offload=train.fsdp_offload, tensor_parallel=train.tensor_parallel)
    panels = [(f"fastest: {choice.policy}, {train.batch_size} x {train.grad_accum}, {train.precision}", w.snapshot(choice.policy))]
    panels += [("none", w.snapshot("none"))] if choice.policy != "none" else []
    card = w.target.gpu.memory if w.target.gpu else None
    png = draw(panels, Path(cfg.report) / "fit.png", budget=cfg.budget, card=card, title=w.describe())
    print(f"report: {png}" if png else "no fit.png: matplotlib is not installed")



def _largest_model(cfg: FitConfig) -> int:
    w = cfg.workload
    rows = largest_model(w, cfg.budget, host_budget=cfg.host_budget)
    rows += largest_pipelined(w, cfg.budget) if cfg.search_pipeline else []
    base = w.train.model
    print(f"The largest {base.arch} model of this shape ({base.n_embed // base.n_blocks} wide a block, heads of "
          f"{base.head_dim}{f', {base.kv_heads} key/value heads' if base.n_kv_head else ''}, MLP "
          f"{base.mlp_hidden / base.n_embed:g}x) that trains at batch {w.train.batch_size} x {w.context} on "
          f"{w.where()}, {w.precision_name()}; "
          f"budget {format_bytes(cfg.budget)}"
          + (f", host memory {format_bytes(cfg.host_budget)}" if w.target.cuda else "") + ":\n")
    print("| optimizer | blocks x width | parameters | vs AdamW | held / parameter | predicted peak | host memory | "
          "tokens/s | val loss vs AdamW | checkpointing |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    first = rows[0].params or None
    for r in rows:
        loss = LOSS_COST.get(r.setting.split(";")[0], "-")  # a pipeline row's cost is its optimizer's
        if r.model is None:
            print(f"| {r.setting} | - | - | - | - | - | - | - | {loss} | {r.note or 'not even one block fits'} |")
            continue
        vs = f"{r.params / first:.2f}x" if first else "-"
        held = (r.prediction.params + r.prediction.grads + r.prediction.optimizer) / r.params
        print(f"| {r.setting} | {r.model.n_blocks} x {r.model.n_embed} | {format_count(r.params)} | {vs} | {held:.2f} | "
              f"{format_bytes(r.prediction.peak)} | {format_bytes(r.host) if r.host else '-'} | {r.tokens_per_s:,.0f} | "
              f"{loss} | `{r.plan.spec()}` |")
    clip = w.train.optim.grad_clip
    print(f"\n({sum(r.profiles for r in rows)} profiles, each size's own, exact. "
          + (f"Clipping at {clip:g}: with the step in the backward, two forward and backward passes a step "
             "(--optim.grad-clip 0: one). " if clip > 0 else "")
          + "Held: weights, gradients and optimizer state at the peak, per parameter. Val loss: the README's first run, "
            "one run each (benchmarks/RESULTS.md). "
          + "Low-bit AdamW steps compiled on CUDA; planned here as its eager step (temporaries measured on CPU), "
            "not yet checked on a card."
          + (" Host memory: pinned, the optimizer's (weights' fp32 copies, gradients, moments); its step timed at this "
             "machine's CPU AdamW rate, the copies at the card's host link (modelled)." if any(r.host for r in rows) else "")
          + ")")
    best = max((r for r in rows if r.model is not None), key=lambda r: r.params, default=None)
    if best is not None:
        train = dataclasses.replace(w.train, model=best.model, optim=best.optim, grad_accum=1,
                                    activation_checkpointing=best.plan.spec(), precision=best.precision,
                                    **dict(best.settings))
        print(f"train the largest: {train_command(train, w.world_size)}")
    print(json.dumps({"budget": cfg.budget, "rows": [
        {"setting": r.setting, "n_blocks": r.model and r.model.n_blocks, "n_embed": r.model and r.model.n_embed,
         "params": r.params, "policy": r.plan and r.plan.spec(), "predicted_peak": r.prediction and r.prediction.peak,
         "tokens_per_s": r.tokens_per_s, "profiles": r.profiles, "note": r.note, "host_bytes": r.host,
         "val_loss_vs_adamw": LOSS_COST.get(r.setting.split(";")[0]), "layout": dict(r.settings)} for r in rows]}))
    return 0
