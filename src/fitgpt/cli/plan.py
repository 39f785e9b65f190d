"""`fitgpt plan --memory-budget 6GiB`: the fastest checkpointing plan whose predicted peak fits."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fitgpt.cli.workload import BudgetConfig, parse_workload
from fitgpt.command import ranks_per_node
from fitgpt.config import TrainConfig
from fitgpt.errors import UserError, require_not_empty
from fitgpt.estimate.hardware import CUDA_CONTEXT
from fitgpt.estimate.profile import BLOCK_OPTIONS, named_options
from fitgpt.estimate.timing import host_seconds_per_byte
from fitgpt.memory.picture import draw, peak_of, timeline
from fitgpt.memory.snapshot import first_difference, read_snapshot, write_snapshot
from fitgpt.optim import describe_optimizer
from fitgpt.plan.solver import Plan, PlanError, predict, solve
from fitgpt.units import format_bytes
from fitgpt.utils import outputs_apart, writable_dir


@dataclass
class PlanConfig(BudgetConfig):
    """Profile the model once per option, then solve for the fastest plan within the budget."""

    activation_checkpointing: str = "auto"
    """As for fitgpt train: auto solves for the fastest plan within the budget; a policy (block, selective,
    blocks:0,1+chunked-loss, ...) is predicted as given."""
    report: Optional[str] = None
    """Write the picture of where the memory goes into this folder: plan.png (memory over the step stacked by
    category, the plan beside none and block on one scale, the budget and the card as lines) and plan.json."""
    memory_snapshot: Optional[str] = None
    """Write the plan's step as a PyTorch memory snapshot (.pickle) for pytorch.org/memory_viz or
    `python -m torch.cuda._memory_viz trace_plot FILE -o out.html`: predicted, for a card this machine may lack."""
    compare: Optional[str] = None
    """A measured snapshot (fitgpt train --memory-snapshot N, or torch.cuda.memory._dump_snapshot) to compare the
    plan's step with: the first point where they part is named, and --report draws both."""

    def __post_init__(self) -> None:
        require_not_empty(self, ("report", "memory_snapshot", "compare"))
        report = Path(self.report) if self.report else None
        outputs_apart({"--compare": self.compare, "--config": self.config, "--hf-config": self.hf_config},
                      [("--memory-snapshot", self.memory_snapshot), ("--report", report and report / "plan.json"),
                       ("--report", report and report / "plan.png")])
        super().__post_init__()  # the trainer's refusals, the split's among them, over --world-size ranks
        if self.activation_checkpointing != "auto":
            self.check_policy(self.activation_checkpointing)
        if self.compare:  # read now: a file that is not a snapshot is refused before anything is profiled
            object.__setattr__(self, "_measured", read_snapshot(self.compare) if Path(self.compare).is_file() else None)
            if self._measured is None:
                raise UserError(f"--compare {self.compare}: no such snapshot file")
        if self.report:
            writable_dir(Path(self.report), "--report")
        if self.memory_snapshot:
            if Path(self.memory_snapshot).is_dir():
                raise UserError(f"--memory-snapshot {self.memory_snapshot} is a folder; name a file, e.g. plan.pickle")
            writable_dir(Path(self.memory_snapshot).parent, "--memory-snapshot")


    def launch_config(self) -> TrainConfig:
        # As the trainer refuses it, but for auto: the trainer cannot plan it per rank, this command does.
        spec = "none" if self.activation_checkpointing == "auto" else self.activation_checkpointing
        return dataclasses.replace(self.train_config(), activation_checkpointing=spec)


def _pictures(cfg: PlanConfig, spec: str, budget: int) -> None:
    """--memory-snapshot, --compare and --report: the plan's step as PyTorch's snapshot, against a measured one, drawn."""
    if not (cfg.report or cfg.memory_snapshot or cfg.compare):
        return
    w = cfg.workload
    mine = w.snapshot(spec)
    if cfg.memory_snapshot:
        print(f"memory snapshot (predicted, PyTorch's format): {write_snapshot(mine, cfg.memory_snapshot)}; open it at "
              "https://pytorch.org/memory_viz")
    measured = cfg._measured if cfg.compare else None
    if measured is not None:
        where = first_difference(mine, measured)
        print(f"against {cfg.compare}: " + (f"they part at {where}" if where else "the same step, event for event"))
    if cfg.report:
        out = Path(cfg.report)
        panels = [(f"plan: {spec}", mine)] + ([("measured", measured)] if measured is not None else [])
        panels += [(p, w.snapshot(p)) for p in ("none", "block") if p != spec and measured is None]
        card = w.target.gpu.memory if w.target.gpu else None
        png = draw(panels, out / "plan.png", budget=budget, card=card, title=w.describe())
        peaks = {label: dict(zip(("event", "bytes"), peak_of(timeline(s)))) for label, s in panels}
        (out / "plan.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({"policy": spec, "budget": budget, "card": card, "peaks": peaks}, indent=1))
        print(f"report: {out / 'plan.json'}" + (f", {png}" if png else " (no plan.png: matplotlib is not installed)"))


def _checkpoint_staging(cfg: PlanConfig, profile, tcfg: TrainConfig) -> tuple[int, TrainConfig]:
    """Under torchrun a background checkpoint first copies each rank's weights and optimizer state to host memory:
    printed, and counted against --host-memory for the ranks one machine runs. Returns the bytes a rank stages, and
    the run to train (one that saves synchronously if the copies do not fit)."""
    if cfg.world_size <= 1 or not tcfg.background_saves(cfg.workload.target.device):
        return 0, tcfg
    per_rank, ranks = profile.params + profile.optimizer, ranks_per_node(cfg.world_size)
    fits = per_rank * ranks + profile.host <= cfg.host_budget
    print(f"checkpoints (--async-checkpoint {tcfg.async_checkpoint}): each rank copies its weights and optimizer state, "
          f"{format_bytes(per_rank)}, "
          f"to host memory and writes them while training goes on: {format_bytes(per_rank * ranks)} for the {ranks} "
          f"rank{'s' if ranks > 1 else ''} of one machine, of {format_bytes(cfg.host_budget)} (--host-memory"
          f"{'' if cfg.host_memory else ', this machine'}): " + ("fits" if fits else "DOES NOT FIT, so the command below "
                                                                 "saves synchronously (--async-checkpoint off)"))
    return per_rank, tcfg if fits else dataclasses.replace(tcfg, async_checkpoint="off")


def _cuda_notes(cfg: PlanConfig) -> list[str]:
    """What the numbers for a CUDA target rest on: modelled here, not measured on the card."""
    w = cfg.workload
    backend = w.target.attention_backend(w.dtype, w.model.head_dim)
    t = w.target
    card = (f"{t.gpu.name}, {format_bytes(t.gpu.memory)}, sm {t.gpu.sm[0]}.{t.gpu.sm[1]} (source: {t.gpu.source})" if t.gpu
            else "none named (sm 8.0 or newer assumed)")
    notes = [f"card: {card}"]
    if t.gpu and cfg.device_budget > t.gpu.memory - CUDA_CONTEXT:
        notes.append(f"note: --memory-budget {format_bytes(cfg.device_budget)} is more than the card leaves after the CUDA "
                     f"context ({format_bytes(t.gpu.memory - CUDA_CONTEXT)}); the check against the card is below")
    return notes + [
        f"budget: {format_bytes(cfg.device_budget)}"
        + ("" if cfg.memory_budget else f" (card less {format_bytes(CUDA_CONTEXT)} for the CUDA context, modelled)")
        + f", less {format_bytes(t.workspace_bytes())} of cuBLAS workspaces (2 handles, modelled) = {format_bytes(cfg.budget)} "
        "for the step's tensors",
        "allocator: expandable segments (expandable_segments:True: one segment a pool, grown by 2 MiB / 20 MiB pages)"
        if t.expandable_segments else "allocator: the default caching allocator (PYTORCH_CUDA_ALLOC_CONF: no "
        "expandable_segments; --alloc-conf expandable_segments:True plans for it)",
        f"modelled: attention backend {backend} "
        + ("(run here as the math path)" if backend == "math" else "(its saved tensors from PyTorch's meta kernels)")
        + f"; allocator blocks of 512 bytes; {describe_optimizer(w.train.optim, torch.device('cuda'))}"
        + ("; autocast casts by CUDA's rules (this PyTorch's lists)" if w.dtype else "")
        + ". Measured: nothing on a GPU (fake tensors on this CPU)",
    ]


def _over_card(cfg: PlanConfig, replay: dict | None) -> int:
    """Bytes by which the replayed step's reserved memory and the CUDA context exceed the named card (0: it fits)."""
    t = cfg.workload.target
    if not replay or not t.gpu:
        return 0
    return max(0, replay["max_reserved"] + CUDA_CONTEXT - t.gpu.memory)


def _solve_on_card(cfg: PlanConfig, profile, budget: int):
    """The fastest plan within ``budget``, its allocator replay and the bytes it overflows the card by. Without
    --memory-budget the default budget is the card's: lowered until the replayed reserved memory (fragmentation
    included) fits on the card too."""
    while True:
        try:
            plan, pred = solve(profile, budget)
        except PlanError as e:
            if budget == cfg.budget:
                raise
            raise PlanError(f"{e} (The budget was lowered from the card's {format_bytes(cfg.budget)}: the plans that fit "
                            "it reserve more than the card has, by the allocator's fragmentation, modelled.)") from None
        replay = cfg.workload.replay(plan.spec())
        over = _over_card(cfg, replay)
        if not over or cfg.memory_budget:
            return plan, pred, replay, budget, over
        budget -= over + 2 * 2**20  # and a step of the allocator's 2 MiB blocks, so that this converges


def _as_given(cfg: PlanConfig, profile, budget: int):
    """The policy --activation-checkpointing names, predicted and replayed as it is (the profile's nearest plan where
    it runs blocks together as one region), with the bytes it overflows the card by."""
    spec = cfg.activation_checkpointing
    plan, exact = Plan.profiled(spec, profile)
    replay = cfg.workload.replay(spec)
    return plan, predict(profile, plan), replay, budget, _over_card(cfg, replay), exact


def _budget_flag(cfg: PlanConfig, budget: int) -> str:
    """The --memory-budget that plans as this one did: as given, or the default (maybe lowered), in whole MiB."""
    return cfg.memory_budget or f"{(cfg.device_budget - (cfg.budget - budget)) // 2**20}MiB"


def run(args: list[str]) -> int:
    cfg = parse_workload(PlanConfig, args, "fitgpt plan")
    if cfg.pipeline_parallel > 1:
        from fitgpt.cli.plan_pipeline import run_pipeline

        return run_pipeline(cfg)
    w = cfg.workload
    tcfg = w.train
    given = cfg.activation_checkpointing != "auto"
    profile = w.profile(extra_options=named_options(cfg.activation_checkpointing))  # torchtitan's rule, where named
    if given:
        plan, pred, replay, budget, over, exact = _as_given(cfg, profile, cfg.budget)
    else:
        (plan, pred, replay, budget, over), exact = _solve_on_card(cfg, profile, cfg.budget), True
    spec = cfg.activation_checkpointing if given else plan.spec()  # what to train with: as given, or as solved
    print(f"{w.describe()}; budget {format_bytes(budget)}; profiled in {profile.seconds:.1f}s")
    if w.target.cuda and w.fake:
        print("\n".join("  " + line for line in _cuda_notes(cfg)))
        if budget < cfg.budget:
            print(f"  budget lowered by {format_bytes(cfg.budget - budget)} from the card's, so that the plan's reserved "
                  "memory (the allocator's blocks and fragmentation, modelled) fits on the card")
    if w.fsdp_ranks > 1:
        print(f"  ranks: one of {w.fsdp_ranks} under FSDP2, profiled on {w.fsdp_ranks} fake ranks (PyTorch's fake process "
              f"group) and sharded as the trainer shards: weights gathered in {w.dtype or 'fp32'} block by block, "
              "gradients reduce-scattered in fp32; the gathers' time is estimated from link bandwidths by fit, not here")
    print(f"  time model: {profile.time_source}")
    print("\n| policy | predicted peak | step time | time vs none | FLOPs vs none | fits |\n|---|---:|---:|---:|---:|---|")
    n = profile.n_blocks
    # Each head beside the option it pairs with best: the chunked loss with block (both recompute), the fused one with
    # pointwise (neither does).
    heads = [Plan.uniform(n, "pointwise" if h == "fused" else "block", h) for h in profile.heads if h != "plain"]
    for row in [Plan.uniform(n, o) for o in BLOCK_OPTIONS] + heads:
        p = predict(profile, row)  # the table's rows: the plan solved above stays `plan`
        print(f"| {row.spec()} | {format_bytes(p.peak)} | {p.step_time * 1e3:.0f} ms | {p.time_ratio:.3f}x | "
              f"{p.flops_ratio:.3f}x | {'yes' if p.peak <= budget else 'no'} |")
    # The ranks of one tensor-parallel group train the same batch: the step's tokens are the data-parallel groups'.
    tokens = tcfg.batch_size * tcfg.grad_accum * w.context * cfg.world_size // tcfg.tensor_parallel
    how = (f"as given{'' if exact else f', predicted as {plan.spec()}, its nearest profiled plan'}; "
           f"{'fits' if pred.peak <= budget else 'DOES NOT FIT the budget'}") if given else "the fastest that fits"
    print(f"\nplan: {spec} ({how}: {pred.step_time * 1e3:.0f} ms a step, "
          f"{pred.time_ratio:.3f}x none's, {tokens / pred.step_time:,.0f} tokens/s predicted)")
    print(f"predicted peak {format_bytes(pred.peak)} of {format_bytes(budget)} (in the {pred.where}): "
          + ", ".join(f"{k} {format_bytes(v)}" for k, v in pred.breakdown().items()))
    host_over = max(0, profile.host - cfg.host_budget)
    if profile.host:
        print(f"on the host (--optim.offload): {format_bytes(profile.host)} of pinned memory, the weights' fp32 copies, "
              f"their gradients and the optimizer state, of {format_bytes(cfg.host_budget)} (--host-memory"
              f"{'' if cfg.host_memory else ', this machine'}): "
              + (f"DOES NOT FIT, {format_bytes(host_over)} over" if host_over else "fits")
              + f"; its step timed at this machine's CPU AdamW rate ({1e-9 / host_seconds_per_byte():.1f} GB/s), the "
              "copies at the card's host link (modelled)")
    staging, tcfg = _checkpoint_staging(cfg, profile, tcfg)
    workspaces = w.target.workspace_bytes()
    if workspaces:
        print(f"predicted torch.cuda.max_memory_allocated: {format_bytes(pred.peak + workspaces)} "
              f"(the step's tensors + cuBLAS workspaces)")
    if replay:
        print(f"the plan's step replayed through CUDA's caching allocator (modelled): max_memory_allocated "
              f"{format_bytes(replay['max_allocated'])}, max_memory_reserved {format_bytes(replay['max_reserved'])}")
        t = w.target
        if t.gpu:
            total = replay["max_reserved"] + CUDA_CONTEXT
            verdict = "fits" if not over else f"DOES NOT FIT: lower --memory-budget by {format_bytes(over)} or more"
            print(f"on the card: reserved + CUDA context {format_bytes(total)} of {format_bytes(t.gpu.memory)}: {verdict}")
    print(f"predicted overhead: {pred.time_ratio:.3f}x time, {pred.flops_ratio:.3f}x FLOPs")
    if over or pred.peak > budget or host_over:
        where = f"on the {w.target.gpu.name}" if over else "the host's memory" if host_over else "the budget"
        print(f"no train command: this plan does not fit {where}")
    else:
        planned = dataclasses.replace(tcfg, activation_checkpointing=spec)
        auto = not w.source  # the trainer plans auto for fitgpt's own models
        print(w.how_to_train(planned) + (f"   (or: --activation-checkpointing auto --memory-budget {_budget_flag(cfg, budget)})"
                                         if auto else ""))
    _pictures(cfg, spec, budget)
    print(json.dumps({"policy": spec, "budget": budget, "predicted_peak": pred.peak, "where": pred.where,
                      "breakdown": pred.breakdown(), "flops_ratio": pred.flops_ratio, "profile_seconds": profile.seconds,
                      "step_seconds": pred.step_time, "time_ratio": pred.time_ratio, "time_model": profile.time_source,
                      "target": w.target.device, "gpu": cfg.gpu, "fake": w.fake,
                      "predicted_max_allocated": pred.peak + workspaces, "replay": replay, "fits_card": not over,
                      "fits_budget": pred.peak <= budget, "host_bytes": profile.host, "fits_host": not host_over,
                      "checkpoint_staging_bytes": staging, "async_checkpoint": tcfg.background_saves(w.target.device)}))
    return 0
