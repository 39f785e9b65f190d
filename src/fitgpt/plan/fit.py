"""`fitgpt fit`: the largest batch, context and depth that train within a budget, per policy.

Profiles are cheap at small sizes, and every quantity in them is a polynomial of low degree in the
batch (bytes and FLOPs are linear in it) and the context (linear with flash attention, quadratic
with the math kernel). So we profile at small sizes, fit each number exactly through them (Lagrange),
and search on the extrapolated profile. Depth needs no new profile: blocks are alike, and one more
block adds its parameters, gradients, optimizer state and segments.
"""

from __future__ import annotations

import dataclasses
import logging
import math

from fitgpt.activation_checkpoint.policy import DEFAULT_LOSS_CHUNK_ROWS
from fitgpt.plan.profile import BlockOption, HeadOption, StepProfile
from fitgpt.plan.solver import Plan, PlanError, predict, solve
from fitgpt.plan.workload import WorkloadConfig

log = logging.getLogger(__name__)

POLICIES = ("none", "block", "auto")


def _lagrange(xs: list[int], ys: list[float], x: int) -> float:
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        term = yi
        for j, xj in enumerate(xs):
            if j != i:
                term *= (x - xj) / (xi - xj)
        total += term
    return total


def extrapolate(points: list[tuple[int, StepProfile]], x: int, field_name: str) -> StepProfile:
    """The profile at size ``x``, every integer in it fitted through ``points`` (size, profile)."""
    xs = [p[0] for p in points]

    def fit(values: list):
        v0 = values[0]
        if isinstance(v0, bool) or not isinstance(v0, (int, list, dict, BlockOption, HeadOption)):
            return values[-1]
        if isinstance(v0, int):
            return max(0, round(_lagrange(xs, values, x))) if min(values) >= 0 else round(_lagrange(xs, values, x))
        if isinstance(v0, list):
            return [fit([v[i] for v in values]) for i in range(len(v0))]
        if isinstance(v0, dict):
            return {k: fit([v[k] for v in values]) for k in v0}
        return type(v0)(**{f.name: fit([getattr(v, f.name) for v in values]) for f in dataclasses.fields(v0)})

    profiles = [p[1] for p in points]
    kwargs = {f.name: fit([getattr(p, f.name) for p in profiles]) for f in dataclasses.fields(StepProfile)}
    kwargs[field_name] = x
    return StepProfile(**kwargs)


def _fits(profile: StepProfile, policy: str, budget: int) -> bool:
    if policy == "auto":
        try:
            solve(profile, budget)
            return True
        except PlanError:
            return False
    option = "none" if policy == "none" else "full"
    return predict(profile, Plan.uniform(profile.n_blocks, option)).peak <= budget


def _largest(at, policy: str, budget: int, lo: int, cap: int) -> int:
    """Largest n in [lo, cap] with at(n) fitting under ``policy`` (0 if even lo does not)."""
    if not _fits(at(lo), policy, budget):
        return 0
    hi = lo
    while hi < cap and _fits(at(min(cap, hi * 2)), policy, budget):
        hi = min(cap, hi * 2)
    if hi == cap:
        return cap
    bad = min(cap, hi * 2)
    while bad - hi > 1:
        mid = (hi + bad) // 2
        if _fits(at(mid), policy, budget):
            hi = mid
        else:
            bad = mid
    return hi


def fit(w: WorkloadConfig, budget: int, max_batch: int = 4096, max_context: int = 1 << 17, max_blocks: int = 1024) -> dict:
    """For none, block and auto: the largest batch, context and number of blocks within ``budget``."""
    tcfg = w.train_config()
    mcfg = w.model_config
    B, T = tcfg.batch_size, mcfg.context_length

    def prof(batch: int, context: int) -> StepProfile:
        return w.profile(batch, context)

    # The chunked loss holds one chunk of logits at a time: its bytes are affine in the tokens only
    # once there is at least one full chunk, so every profile point has that many tokens.
    b0 = max(4, math.ceil(DEFAULT_LOSS_CHUNK_ROWS / T))  # below a few rows per batch, bytes are not yet affine
    by_batch = [(b, prof(b, T)) for b in (b0, 2 * b0)]
    c0 = max(8, T // 8, math.ceil(DEFAULT_LOSS_CHUNK_ROWS / B))
    by_context = [(c, prof(B, c)) for c in (c0, 2 * c0, 3 * c0)]
    here = prof(B, T)
    answers: dict[str, dict[str, int]] = {}
    for policy in POLICIES:
        answers[policy] = {
            "batch_size": _largest(lambda b: extrapolate(by_batch, b, "batch_size"), policy, budget, 1, max_batch),
            "context": _largest(lambda c: extrapolate(by_context, c, "context"), policy, budget, 1, max_context),
            "n_blocks": _largest(here.with_blocks, policy, budget, 1, max_blocks),
        }
    return {
        "workload": w.describe(), "budget": budget, "answers": answers,
        "current": {"batch_size": B, "context": T, "n_blocks": mcfg.n_blocks},
        "note": f"batch and context extrapolated from profiles at batch {b0}, {2 * b0} and at contexts "
                f"{c0}, {2 * c0}, {3 * c0}; depth from the profile at batch {B} x {T}",
    }
