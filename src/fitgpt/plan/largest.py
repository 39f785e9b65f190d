"""`fitgpt fit`, first half: the largest batch, context and depth that train within a budget, per policy
(the second half, the fastest configuration, is `fitgpt.plan.fastest`).

Every quantity in a profile is a polynomial of low degree in the batch (bytes and FLOPs are linear
in it) and the context (linear with flash attention, quadratic with the math kernel). So a few
profiles, fitted exactly through (Lagrange), bracket the answer; then the answer is settled with
exact profiles at the candidate sizes themselves (fake tensors make each one cheap): n fits and
n + 1 does not, both on a profile of that very size. Depth needs no new profile: blocks are alike,
and one more block adds its parameters, gradients, optimizer state and segments.
"""

from __future__ import annotations

import logging
import math

from fitgpt.activation_checkpoint.policy import DEFAULT_LOSS_CHUNK_ROWS
from fitgpt.errors import UserError
from fitgpt.estimate.profile import StepProfile, named_options
from fitgpt.estimate.workload import Workload
from fitgpt.plan.extrapolate import extrapolate
from fitgpt.plan.solver import Plan, PlanError, min_peak, predict, solve
from fitgpt.utils import in_processes

log = logging.getLogger(__name__)

POLICIES = ("none", "block", "auto")
EXACT_TOKENS = 2**18
"""Answers up to this many tokens per micro-batch are settled on exact profiles; larger ones are extrapolated."""


def _fits(profile: StepProfile, policy: str, budget: int) -> bool:
    if policy == "auto":
        if any(predict(profile, Plan.uniform(profile.n_blocks, o, h)).peak <= budget
               for o in profile.blocks[0] for h in profile.heads):
            return True  # one prediction each, where the search over plans grows with the depth probed
        try:
            solve(profile, budget)
            return True
        except PlanError:
            return False
    return _peak(profile, policy) <= budget


def _peak(profile: StepProfile, policy: str) -> float:
    """The predicted peak of a policy as given (its nearest profiled plan); infinite where the policy names blocks
    the model at this depth does not have."""
    try:
        plan, _ = Plan.profiled(policy, profile)
    except UserError:
        return math.inf
    return predict(profile, plan).peak


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


def _excess(profile: StepProfile, policy: str, budget: int) -> int:
    """Bytes by which the policy's peak exceeds ``budget`` (<= 0: it fits); for auto, the lowest plan's."""
    if policy == "auto":
        return min_peak(profile)[1].peak - budget
    return _peak(profile, policy) - budget


def _settle(exact, policy: str, budget: int, guess: int, cap: int) -> int:
    """The largest n in [1, cap] that fits on exact profiles: n fits and n + 1 does not (0 if 1 does not).

    From ``guess``, each probe aims where the excess bytes would be zero (a secant through the last two
    probes), staying inside the bracket of sizes known to fit and not; bisection closes what is left.
    A good guess costs two profiles."""
    fits_at, fails_at = 0, cap + 1  # the largest size known to fit, the smallest known not to
    n, prev = min(max(guess, 1), cap), None
    for _ in range(8):
        e = _excess(exact(n), policy, budget)
        fits_at, fails_at = (max(fits_at, n), fails_at) if e <= 0 else (fits_at, min(fails_at, n))
        if fails_at - fits_at <= 1:
            return fits_at
        slope = (prev[1] - e) / (prev[0] - n) if prev else (e + budget) / n  # bytes per unit of size
        prev = (n, e)
        n = min(max(math.floor(n - e / max(slope, 1.0)), fits_at + 1), fails_at - 1, cap)
    while fails_at - fits_at > 1:
        mid = (fits_at + fails_at) // 2
        fits_at, fails_at = (mid, fails_at) if _excess(exact(mid), policy, budget) <= 0 else (fits_at, mid)
    return fits_at


def largest(w: Workload, budget: int, max_batch: int = 4096, max_context: int = 1 << 17, max_blocks: int = 1024,
            given: str | None = None, workers: int | None = None) -> dict:
    """For none, block and auto (and the policy ``given``, as given, if another): the largest batch, context and
    number of blocks within ``budget``. The batch and the context are independent searches, each single-threaded
    Python on fake tensors: side by side in ``workers`` processes (default: one per CPU core, at most two)."""
    B, T = w.train.batch_size, w.context
    policies = POLICIES + ((given,) if given and given not in POLICIES else ())
    named = named_options(given) if given else ()
    b0 = max(4, math.ceil(DEFAULT_LOSS_CHUNK_ROWS / T))  # below a few rows per batch, bytes are not yet affine
    c0 = max(8, T // 8, math.ceil(DEFAULT_LOSS_CHUNK_ROWS / B))
    jobs = {"batch_size": (w, "batch_size", policies, budget, named, (b0, 2 * b0), max_batch),
            "context": (w, "context", policies, budget, named, (c0, 2 * c0, 3 * c0), max_context)}
    found = dict(zip(jobs, in_processes(_along, list(jobs.values()), workers)))
    here = w.profile(B, T, extra_options=named)  # depth needs no other: one block more adds its bytes and segments
    answers = {p: {"batch_size": found["batch_size"][0][p], "context": found["context"][0][p],
                   "n_blocks": _largest(here.with_blocks, p, budget, 1, max_blocks)} for p in policies}
    extrapolated = found["batch_size"][1] + found["context"][1]
    profiles = found["batch_size"][2] + found["context"][2] + 1
    return {
        "workload": w.describe(), "budget": budget, "answers": answers, "policies": list(policies),
        "current": {"batch_size": B, "context": T, "n_blocks": w.model.n_blocks},
        "profiles": profiles, "extrapolated": extrapolated,
        "note": f"batch and context bracketed from profiles at batch {b0}, {2 * b0} and contexts {c0}, {2 * c0}, {3 * c0}, "
                f"then settled on exact profiles of the sizes named ({profiles} profiles in all"
                + (f"; extrapolated only, over {EXACT_TOKENS} tokens: {', '.join(extrapolated)}" if extrapolated else "")
                + f"); depth from the profile at batch {B} x {T}",
    }


def _along(w: Workload, dim: str, policies: tuple[str, ...], budget: int, named: tuple[str, ...], points: tuple[int, ...],
           cap: int) -> tuple[dict[str, int], list[str], int]:
    """Per policy, the largest ``dim`` (batch_size or context; the other as ``w`` has it) within ``budget``: bracketed
    from exact fits through profiles at ``points``, then settled on exact profiles of the sizes named. Also which
    answers were only extrapolated, and how many profiles were taken."""
    B, T = w.train.batch_size, w.context
    cache: dict[int, StepProfile] = {}

    def prof(n: int) -> StepProfile:
        if n not in cache:
            cache[n] = w.profile(*((n, T) if dim == "batch_size" else (B, n)), extra_options=named)
        return cache[n]

    # The chunked loss holds one chunk of logits at a time: its bytes are affine in the tokens only
    # once there is at least one full chunk, so every profile point has that many tokens.
    fitted = [(n, prof(n)) for n in points]
    other = T if dim == "batch_size" else B
    answers, extrapolated = {}, []
    for policy in policies:
        guess = _largest(lambda n: extrapolate(fitted, n, dim), policy, budget, 1, cap)
        # A profile's cost grows with the chunked loss's chunks: past EXACT_TOKENS the bracket is the answer.
        if guess * other > EXACT_TOKENS:
            extrapolated.append(f"{policy} {dim.split('_')[0]}")
            answers[policy] = guess
        else:
            answers[policy] = _settle(prof, policy, budget, guess, cap)
    return answers, extrapolated, len(cache)
