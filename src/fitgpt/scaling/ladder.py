"""`fitgpt ladder`: a ladder of small models of one family (`family`), trained on the user's data within a time budget,
and the scaling law fitted through their losses (`law`).

Each depth trains once under warmup-stable-decay (WSD): the learning rate held after the warmup, then decayed over
the run's last fifth. Its stable part is the same whatever the run's length, so a checkpoint taken there and trained
on through a cooldown of its own (a fifth of the branch) is the shorter run's end: Hägele et al. (2024) find such
cooldowns give the loss a run of that length would (cosine's, too). Each depth gives three points for about 1.2 times
one run's compute: its end, and two branches from a quarter and a half of it (where they are past the warmup).

Which depths, and each one's share of the time, is the design's (`design`): every depth's step is timed first, then
each trains to the same compute (the smaller ones see more tokens), so that the three points of every depth sit at
three shared compute levels (the iso-FLOP profiles, `isoflop`), each past the tokens a parameter where the law's form
applies; the shares are set anew from the time left once a depth has run."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from fitgpt.config import TrainConfig
from fitgpt.data.loader import TokenData
from fitgpt.data.prepare import ensure_prepared
from fitgpt.device import autocast_dtype, resolve_device
from fitgpt.errors import UserError
from fitgpt.estimate.throughput import measured_tokens_per_s
from fitgpt.memory.tracker import round_up
from fitgpt.scaling import design
from fitgpt.scaling.family import NANOCHAT, Family, compute_params, non_embedding_params, warmup_for
from fitgpt.scaling.isoflop import iso_flop
from fitgpt.scaling.law import Law, fit_law
from fitgpt.scaling.record import LadderRecord, Rung
from fitgpt.train import checkpoint as ckpt
from fitgpt.train.trainer import train

log = logging.getLogger(__name__)

Clock = Callable[[], float]

BRANCHES = (0.25, 0.5)
"""Where along each depth's run a cooldown branches off (fractions of its steps)."""
FIT_RESERVE = 0.1
"""The budget's share kept for the fit, its bootstrap (as many refits as the time left allows) and the picture."""
MIN_STEPS = 8
"""A depth's run at the least: two steps a quarter, so that its branches start past a warmup of one step."""
BRANCH_SLACK = 0.15
"""A depth's share kept beside its branches' steps, for their own setup, evaluation and save (what the next depths
do not need is theirs)."""
RUN_START_S = 2.0
"""A ladder's run's time besides its steps, at the least (its model built and its activations measured, its evaluation
and last save): 1-3 s on this project's 2-core CPU."""
PROBE_S = 2.0
"""A depth's step timed before its run (`measure_throughput`: a model built, two steps of warm-up, 1.5 s of steps)."""
OVERHEAD = 1.3
"""Wall seconds per second of a depth's steps (its runs' setup, evaluations and saves), until one depth measures it."""


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The runs' own logs held back to errors (a branch's changed --max-steps is its design), for the ladder's while."""
    loggers = [logging.getLogger(name) for name in ("fitgpt.train", "fitgpt.data", "fitgpt.activation_checkpoint")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _branch(main: Path, step: int, out: Path, cfg: TrainConfig, clock: Clock) -> dict:
    """From checkpoint ``step`` of the run in ``main``: a run of its own in ``out`` that cools down over a fifth of its
    length (its --max-steps, so that the checkpoint's step is where the decay begins)."""
    shutil.rmtree(out, ignore_errors=True)  # this ladder's own, left by a try that stopped
    (out / "checkpoints").mkdir(parents=True)
    name = f"step_{step:08d}"
    shutil.copytree(main / "checkpoints" / name, out / "checkpoints" / name)
    for f in ("config.json", "tokenizer.json"):
        shutil.copyfile(main / f, out / f)
    return _trained(dataclasses.replace(cfg, out_dir=str(out), time_budget=None, max_steps=branch_steps(step, cfg.optim.cooldown),
                                        resume="latest", overwrite=False), clock)


def _trained(cfg: TrainConfig, clock: Clock) -> dict:
    """One of the ladder's runs; a signal that stopped it stops the ladder (its point would be a cut-short run's)."""
    summary = train(cfg, clock=clock)
    if summary["interrupted"]:
        raise LadderStopped(f"stopped by {summary['interrupted']} in {summary['run_dir']}")
    return summary


def _branching(cooldown: float) -> float:
    """The branches' steps, as a share of their run's: each cools down over a fifth of a run that ends past its start."""
    return sum(BRANCHES) * cooldown / (1 - cooldown)


def branch_steps(step: int, cooldown: float) -> int:
    """A branch's --max-steps from checkpoint ``step``: the run whose last ``cooldown`` share starts there, and at least
    one step past it (round(2 / 0.8) is 2: a branch from step 2 would train nothing)."""
    return max(step + 1, round(step / (1 - cooldown)))


class LadderStopped(Exception):
    """A signal stopped one of the ladder's runs: the depths finished before it are kept in --work-dir (ladder.json),
    and the same command continues the ladder from them."""


def run_ladder(base: TrainConfig, budget: float, depths: tuple[int, ...], work: Path, overwrite: bool,
               started: float | None = None, clock: Clock = time.perf_counter, family: Family = NANOCHAT,
               rules: design.Rules = design.RULES) -> Law:
    """Train the ladder on ``base``'s data and recipe (its schedule made WSD) within ``budget`` seconds counted from
    ``started`` (`time.perf_counter`'s clock: the command's start): the depths of ``family`` among ``depths`` its
    design keeps (``rules``), in run directories under ``work``, and fit the law through its points. A ladder stopped
    part way (LadderStopped, or any signal) keeps the depths it finished in ``work``: the same call continues it, its
    time spent counted. A law its points cannot identify (`Law.problems`) is refused in one line, its runs kept.
    ``clock``: what the budget is read on (a test's own)."""
    started = clock() if started is None else started
    least = 2 * ((1 + len(BRANCHES)) * RUN_START_S + PROBE_S)
    if budget < least:  # the runs' own start-ups alone would overrun it, however fast the steps
        raise UserError(f"--time-budget {budget:.0f}s is less than 2 depths' fixed costs (each depth's step "
                        f"timed, then {1 + len(BRANCHES)} runs' start-up, evaluation and save: about {least:.0f}s): give "
                        "the ladder more time")
    data_cfg, meta = ensure_prepared(base.data, progress=False)
    data = TokenData(data_cfg.path, meta)
    data.check_context(base.model.context_length)
    model = dataclasses.replace(base.model, vocab_size=round_up(data.vocab_size, 64))
    recipe = dataclasses.replace(base, data=data_cfg, model=model, optim=dataclasses.replace(base.optim, schedule="wsd"),
                                 time_budget=None, eval_interval=10**9, log_interval=10**9, progress=False,
                                 tensorboard=False, activation_checkpointing="none", keep_last=10**6)
    record = LadderRecord.open(work, recipe, depths, budget, overwrite, dataclasses.asdict(family))
    origin = started - record.spent  # an earlier try's time counts
    try:
        with _quiet():
            points, rungs = _rungs(recipe, family, depths, budget, origin, work, record, clock, rules)
    except UserError:  # refused before any run (its design, or a budget too small for the first depth): nothing recorded
        raise
    except BaseException:  # stopped (Ctrl-C, a signal, an error): the time it took counts when the ladder continues
        record.spend(clock() - origin)
        raise
    info = {"tokenizer_sha256": data.tokenizer_sha256, "vocab_size": data.vocab_size, "unique_tokens":
            int(meta["train_tokens"]), "dir": str(data_cfg.path)}
    # The bootstrap refits as many times as the budget leaves (its picture's second aside): 200 took 20-60 s here
    law = fit_law(points, info, _recipe_record(recipe, family, rungs, budget), deadline=origin + budget - 1.0, clock=clock)
    law.iso_flop = iso_flop(law, compute_curve(family, model, 2 * max(r.depth for r in rungs) + 2))
    record.finish(clock() - origin)
    short = design.shortfalls(points, rules) if rules.identify else []
    problems = law.problems() + short if rules.identify else []
    if problems:
        law.write(work / "unidentified-law.json")
        slowed = " (its runs trained fewer tokens than their steps were timed for: or a quieter machine)" if short else ""
        raise UserError(f"the ladder's points do not identify a law ({'; '.join(problems)}); its fit is in "
                        f"{work / 'unidentified-law.json'} and its runs in {work}: give it a larger --time-budget "
                        f"(each point more tokens a parameter){slowed} and --overwrite")
    return law


def compute_curve(family: Family, base, upto: int) -> Callable[[float], float]:
    """The compute parameters (`compute_params`) of the family's model of N non-embedding parameters, for any N: log-
    linear between its depths 1 to ``upto`` (held at the ends)."""
    shapes = [family.shape(d, base) for d in range(1, upto + 1)]
    counts = [non_embedding_params(m) for m in shapes]
    n = np.log(counts)
    c = np.log([compute_params(m, k) for m, k in zip(shapes, counts)])
    return lambda x: float(np.exp(np.interp(np.log(x), n, c)))


def _probe(recipe: TrainConfig, family: Family) -> Callable[[int], design.Candidate]:
    def probe(depth: int) -> design.Candidate:
        cfg = dataclasses.replace(recipe, model=family.shape(depth, recipe.model))
        tps = measured_tokens_per_s(cfg, resolve_device(cfg.device))
        n = non_embedding_params(cfg.model)
        return design.Candidate(depth, n, compute_params(cfg.model, n), tps)
    return probe


def _design(recipe: TrainConfig, family: Family, depths: tuple[int, ...], budget: float, started: float,
            record: LadderRecord, clock: Clock, rules: design.Rules) -> list[design.Candidate]:
    """The depths to train, each with its throughput timed now: the design's (recorded), or an earlier try's."""
    probe = _probe(recipe, family)
    if record.design:  # the same depths as the try that was stopped (the machine's speed may have changed since)
        return [probe(d) if d not in record.done else design.Candidate(d, 0, 0, 1.0) for d in record.design]
    small, large = (non_embedding_params(family.shape(d, recipe.model)) for d in (min(depths), max(depths)))
    if large < rules.min_range * small:  # before any depth is timed
        raise UserError(f"--depths {' '.join(map(str, sorted(depths)))} span {large / small:.1f}x in parameters; a law "
                        f"needs {rules.min_range:g}x: add larger --depths")
    cost = (1 + _branching(recipe.optim.cooldown)) * OVERHEAD
    spent = clock() - started
    steps_seconds = (budget * (1 - FIT_RESERVE) - spent) / cost
    hint = " (or a family of smaller models: --aspect 32)" if family.aspect > 32 else ""
    chosen = design.plan(probe, list(depths), steps_seconds, lambda s: (s * cost + spent) / (1 - FIT_RESERVE), rules, hint)
    record.design = [c.depth for c in chosen.depths]
    log.info("the ladder's design: depths %s, each to %.3g FLOPs (%.2f tokens a parameter at the least)",
             record.design, chosen.flops, min(design.LOWEST * c.tokens(chosen.flops) / c.n_params for c in chosen.depths))
    return chosen.depths


def _rungs(recipe: TrainConfig, family: Family, depths: tuple[int, ...], budget: float, started: float, work: Path,
           record: LadderRecord, clock: Clock, rules: design.Rules) -> tuple[list[dict], list[Rung]]:
    """Each depth the design keeps trained, the largest first (the smallest, last, absorb what the timing missed), to
    the compute level the time left gives the depths not yet trained, at the overhead the depth before took; a depth
    finished by an earlier try of the same ladder is taken as it was. The points and the rungs."""
    tokens_per_step = recipe.batch_size * recipe.grad_accum * recipe.model.context_length
    branching = _branching(recipe.optim.cooldown)
    chosen = _design(recipe, family, depths, budget, started, record, clock, rules)
    points, rungs, overhead = [], [], OVERHEAD
    order = sorted(chosen, key=lambda c: c.depth, reverse=True)
    for i, c in enumerate(order):
        if c.depth in record.done:
            rung, kept = record.done[c.depth]
            rungs.append(rung)
            points += kept
            log.info("depth %d: its %d points kept from the ladder's earlier try", c.depth, len(kept))
            continue
        t_depth = clock()
        left = [d for d in order[i:] if d.depth not in record.done]
        flops = design.top_flops(left, (budget * (1 - FIT_RESERVE) - (t_depth - started)) / ((1 + branching) * overhead))
        share = c.seconds(flops) * (1 + branching) * overhead
        steps = int(c.tokens(flops) / tokens_per_step)
        if steps < MIN_STEPS and not points:  # nothing trained yet: refused before any run
            raise UserError(f"--time-budget {budget:.0f}s leaves depth {c.depth} {share:.1f}s, under {MIN_STEPS} steps at "
                            f"the {c.tokens_per_s:,.0f} tokens/s measured: give the ladder more time, or fewer or "
                            "smaller --depths")
        steps = max(steps, MIN_STEPS)
        cfg = dataclasses.replace(recipe, model=family.shape(c.depth, recipe.model))
        cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, warmup_steps=warmup_for(cfg.optim.warmup_steps, steps)))
        rung, rung_points = _rung_points(c.depth, cfg, work, tokens_per_step, steps, t_depth + share, clock)
        rungs.append(rung)
        points += rung_points
        record.add(rung, rung_points, clock() - started)
        # Wall seconds per second of the steps' own compute (setup, evaluation, saves): the next depths' shares.
        overhead = (clock() - t_depth) / max(1e-9, rung.steps * (1 + branching) * tokens_per_step / c.tokens_per_s)
        log.info("depth %d (%s parameters): %d steps at %.0f tokens/s, %d points, %.2fx the steps' time; %.0fs of %.0fs "
                 "spent", c.depth, f"{rung.n_params:,}", rung.steps, c.tokens_per_s, len(rung_points), overhead,
                 clock() - started, budget)
    return points, rungs


def _recipe_record(recipe: TrainConfig, family: Family, rungs: list[Rung], budget: float) -> dict:
    """How the law's points were trained, for law.json: what a run must share with them for the law to speak of it."""
    device = resolve_device(recipe.device)
    dtype = autocast_dtype(recipe.precision, device)
    o = recipe.optim
    return {"family": family.describe(), "aspect": family.aspect, "mup": family.mup, "arch": recipe.model.arch, "device": device.type,
            "precision": {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32"),
            "context": recipe.model.context_length, "batch_size": recipe.batch_size, "grad_accum": recipe.grad_accum,
            "optimizer": o.name, "lr": o.lr, "min_lr": o.min_lr, "warmup_steps": f"min({o.warmup_steps}, a tenth of the run)",
            "schedule": f"wsd, cooldown {o.cooldown}", "preset": recipe.preset, "seed": recipe.seed,
            "eval_batches": recipe.eval_batches, "budget_seconds": budget, "rungs": [dataclasses.asdict(r) for r in rungs]}


def _rung_points(depth: int, cfg: TrainConfig, work: Path, tokens_per_step: int, steps: int, deadline: float,
                 clock: Clock) -> tuple[Rung, list[dict]]:
    """One depth's run, of the time its ``steps`` were planned to take, ended by that deadline (whatever the machine
    does meanwhile), then its cooldown branches from about a quarter and a half of the steps it took, each where it
    still fits before ``deadline`` (on ``clock``): a point each."""
    main = work / f"depth{depth}"
    shutil.rmtree(main, ignore_errors=True)  # this ladder's own, left by a try that stopped
    seconds = (1 - BRANCH_SLACK) * (deadline - clock()) / (1 + _branching(cfg.optim.cooldown))
    run_cfg = dataclasses.replace(cfg, out_dir=str(main), time_budget=f"{max(1.0, seconds):.3f}s", max_steps=10**9,
                                  checkpoint_interval=max(1, steps // 8), overwrite=False)
    t0 = clock()
    summary = _trained(run_cfg, clock)
    setup = clock() - t0 - summary["seconds"]  # the model built, the checkpoint read: a branch's too
    tokens_per_s = tokens_per_step * summary["steps"] / max(1e-9, summary["seconds"])
    n = non_embedding_params(cfg.model)
    rung = Rung(depth, n, compute_params(cfg.model, n), tokens_per_s, summary["steps"])
    points = [_point(rung, rung.steps, tokens_per_step, summary, "end")]
    step_seconds = summary["seconds"] / max(1, rung.steps)  # its evaluation and saves too: a branch's are alike
    for at in _branch_points(main, rung.steps, cfg):
        need = (branch_steps(at, cfg.optim.cooldown) - at) * step_seconds + setup
        if clock() + need > deadline:
            log.warning("depth %d: no cooldown from step %d (about %.0fs, and %.0fs of its share are left)", depth, at,
                        need, deadline - clock())
            continue
        branch = _branch(main, at, work / f"depth{depth}-from{at}", run_cfg, clock)
        points.append(_point(rung, branch["steps"], tokens_per_step, branch, f"cooldown from step {at}"))
    return rung, points


def _branch_points(main: Path, steps: int, cfg: TrainConfig) -> list[int]:
    """The checkpoints of the run in ``main`` (of ``steps`` steps) nearest each of BRANCHES, in its stable part: past
    the warmup, and before the cooldown of its last fifth of its time (its steps a little later than that, the first
    step being the slowest: a twentieth kept aside)."""
    stable = 0.95 * (1 - cfg.optim.cooldown) * steps
    saved = [s for s in (ckpt.step_of(p) for p in ckpt.list_checkpoints(main)) if cfg.optim.warmup_steps < s <= stable]
    if not saved:
        return []
    return sorted({min(saved, key=lambda s: abs(s - f * steps)) for f in BRANCHES})


def _point(rung: Rung, steps: int, tokens_per_step: int, summary: dict, how: str) -> dict:
    tokens = steps * tokens_per_step
    return {"depth": rung.depth, "n_params": rung.n_params, "compute_params": rung.compute_params, "tokens": tokens,
            "flops": 6.0 * rung.compute_params * tokens, "val_loss": summary["val_loss"],
            "val_loss_se": summary.get("val_loss_se"), "run": summary["run_dir"], "how": how}
