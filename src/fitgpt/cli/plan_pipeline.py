"""`fitgpt plan --pipeline-parallel P`: each pipeline rank's peak, planned by running the trainer's schedule as that
rank on fake ranks (`fitgpt.estimate.pipeline`), and the step's time with the schedule's bubble."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from fitgpt.errors import UserError
from fitgpt.estimate.pipeline import StageRank, bubble, pipeline_step_time
from fitgpt.estimate.profile import BLOCK_OPTIONS, named_options
from fitgpt.memory.picture import draw_stages
from fitgpt.plan.solver import Plan, predict
from fitgpt.units import format_bytes


def run_pipeline(cfg) -> int:
    """``cfg``: a parsed PlanConfig with --pipeline-parallel. A named policy is planned as given; auto plans each of
    none, pointwise, selective and block on every rank and picks the first (the least recomputing) whose every rank
    fits."""
    if cfg.memory_snapshot or cfg.compare:
        raise UserError("--memory-snapshot and --compare are one process's step (or one rank's under DDP, FSDP or TP); "
                        "a pipeline's ranks are drawn by --report: use --report DIR")
    w = cfg.workload
    t = w.train
    given = cfg.activation_checkpointing != "auto"
    candidates = [cfg.activation_checkpointing] if given else list(BLOCK_OPTIONS)  # the least recomputing first
    # The step's time on one rank holding every block (torchtitan's rule profiled where the policy names it).
    whole = w.unpipelined().profile(extra_options=named_options(cfg.activation_checkpointing))
    split = bubble(t.pipeline_parallel, t.pipeline_schedule, t.microbatches)
    print(f"{w.describe()}; budget {format_bytes(cfg.budget)} a rank")
    print(f"  each pipeline rank planned by running the trainer's schedule as that rank on {w.world_size} fake ranks "
          "(PyTorch's fake process group); a stage's FSDP and tensor-parallel ranks hold alike")
    if w.target.cuda:
        print("  on the card: the bytes allocated (512-byte blocks, CUDA autocast's dtypes); the caching allocator's "
              "reserved memory, more by its fragmentation, is not replayed for a pipeline yet")
    print(f"  time: one rank holding every block ({whole.time_source}), shared by the {t.pipeline_parallel} stages' ranks, "
          f"plus the bubble (P - 1) / (v M + P - 1) = {split:.1%} of the step; the sends between stages are not timed")
    rows = []
    for spec in candidates:
        stages = w.stages(spec)
        seconds = pipeline_step_time(predict(whole, Plan.profiled(spec, whole)[0]).step_time, t.pipeline_parallel,
                                     t.pipeline_schedule, t.microbatches)
        fits = max(s.peak for s in stages) <= cfg.budget
        rows.append((spec, stages, seconds, fits))
        if fits:
            break
    _table(rows)
    spec, stages, seconds, fits = rows[-1]  # as given; or the first that fits, else the most recomputing
    tokens = t.batch_size * w.context * (w.world_size // t.pipeline_parallel)
    print(f"\nplan: {spec} ({'as given' if given else 'the least recomputing that fits every rank'}: "
          f"{seconds * 1e3:.0f} ms a step, {tokens / seconds:,.0f} tokens/s predicted; "
          f"{'fits' if fits else 'DOES NOT FIT the budget'})")
    _per_rank(stages, cfg.budget)
    if fits:
        print(w.how_to_train(dataclasses.replace(t, activation_checkpointing=spec)))
    else:
        print("no train command: a rank's peak does not fit the budget (more stages, more micro-batches of fewer rows, "
              "or more recomputation)")
    ranks = [dict(dataclasses.asdict(s), activations=s.activations) for s in stages]
    for r in ranks:
        del r["trace"]  # drawn by --report, not printed
    _report(cfg, stages, spec)
    print(json.dumps({"policy": spec, "budget": cfg.budget, "fits_budget": fits, "step_seconds": seconds,
                      "bubble": split, "ranks": ranks}))
    return 0


def _report(cfg, stages: list[StageRank], spec: str) -> None:
    """--report: each rank's memory over its step, one line a rank (plan.png), and the ranks' figures (plan.json)."""
    if not cfg.report:
        return
    w = cfg.workload
    out = Path(cfg.report)
    card = w.target.gpu.memory if w.target.gpu else None
    traces = [(f"rank {s.rank} (blocks {s.describe_blocks()})", list(s.trace)) for s in stages]
    png = draw_stages(traces, out / "plan.png", budget=cfg.budget, card=card, title=f"{w.describe()}; {spec}")
    (out / "plan.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_text(json.dumps({"policy": spec, "budget": cfg.budget, "card": card,
                                               "ranks": [dataclasses.asdict(s) for s in stages]}, indent=1))
    print(f"report: {out / 'plan.json'}" + (f", {png}" if png else " (no plan.png: matplotlib is not installed)"))


def _table(rows: list[tuple]) -> None:
    print("\n| policy | largest rank's peak | smallest rank's peak | step time | fits |\n|---|---:|---:|---:|---|")
    for spec, stages, seconds, fits in rows:
        peaks = [s.peak for s in stages]
        print(f"| {spec} | {format_bytes(max(peaks))} | {format_bytes(min(peaks))} | {seconds * 1e3:.0f} ms | "
              f"{'yes' if fits else 'no'} |")


def _per_rank(stages: list[StageRank], budget: int) -> None:
    print("\n| rank | blocks | weights | gradients | optimizer | receive buffers | activations | peak | fits |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---|")
    for s in stages:
        print(f"| {s.rank} | {s.describe_blocks()} | {format_bytes(s.params)} | {format_bytes(s.grads)} | "
              f"{format_bytes(s.optimizer)} | {format_bytes(s.buffers)} | {format_bytes(s.activations)} | "
              f"{format_bytes(s.peak)} | {'yes' if s.peak <= budget else 'no'} |")
    print(f"planned in {sum(s.seconds for s in stages):.1f}s")
