"""Predict the peak and step time of any plan from a profile, and find the fastest plan under a memory budget.

A plan gives every block an option (none, pointwise, selective, block; torchtitan where profiled; on CUDA also
offload) and the head one
(plain, chunked, fused).
``predict`` walks the step as the profile cut it: the level of live bytes moves by each segment's
measured delta, and each segment adds its measured rise on top.

``solve`` is exact. Every constraint of the walk has the form ``S(i) + term_i(option_i) <= budget``,
where ``S(i)`` is the bytes the blocks before i saved: the forward of block i runs on top of
``S(i)``, and so does its backward (what the later blocks saved is freed by then, but their
gradients are not, and those do not depend on the options). So a dynamic programme over blocks whose
state is ``S`` suffices, and a state with both more saved bytes and more recompute than another can
be dropped: nothing after it can prefer it. The cost is lexicographic: predicted seconds first (the sum
of the plan's segments by the profile's cost model, see ``fitgpt.estimate.timing``), then recomputed
FLOPs (all a profile without a cost model has), then the number of blocks that recompute anything.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from fitgpt.activation_checkpoint.policy import parse_policy
from fitgpt.errors import UserError
from fitgpt.estimate.profile import StepProfile
from fitgpt.units import format_bytes


class PlanError(UserError):
    """No plan fits the budget; the message says by how much, and what to change."""


@dataclass(frozen=True)
class Plan:
    blocks: tuple[str, ...]
    head: str = "plain"

    def spec(self) -> str:
        """The plan as a ``--activation-checkpointing`` policy string."""
        n = len(self.blocks)
        terms = []
        for option, whole, some in (("block", "block", "blocks:"), ("selective", "selective", "selective:"),
                                    ("pointwise", "pointwise", "pointwise:"), ("torchtitan", "torchtitan", "torchtitan:"),
                                    ("offload", "offload", "offload:")):
            ids = [i for i, o in enumerate(self.blocks) if o == option]
            if len(ids) == n:
                terms.append(whole)
            elif ids:
                terms.append(some + ",".join(map(str, ids)))
        if self.head in ("chunked", "fused"):
            terms.append(f"{self.head}-loss")
        return "+".join(terms) or "none"

    @classmethod
    def uniform(cls, n: int, option: str, head: str = "plain") -> Plan:
        return cls(tuple([option] * n), head)

    @classmethod
    def from_policy(cls, spec: str, n: int) -> tuple[Plan, bool]:
        """The plan closest to any policy, and whether it is that policy exactly: a group of blocks recomputed as
        one region runs as many FLOPs as each recomputed alone (its memory differs); offload is an option of a block
        that recomputes nothing."""
        policy = parse_policy(spec)
        regions = policy.regions(n)
        options = [("offload" if r.offload and r.recompute == "none" else r.recompute) for r in regions for _ in range(r.start, r.stop)]
        exact = all(r.stop - r.start == 1 and not (r.offload and r.recompute != "none") for r in regions)
        head = "chunked" if policy.loss_chunk_rows else "fused" if policy.loss_fused_rows else "plain"
        return cls(tuple(options), head), exact

    @classmethod
    def profiled(cls, spec: str, profile: StepProfile) -> tuple[Plan, bool]:
        """The plan ``profile`` can predict nearest to the policy ``spec``, and whether it is that policy exactly: an
        option the profile lacks (offload, profiled only for CUDA, where it moves bytes; on a CPU it does nothing;
        torchtitan's rule where no policy named it) counts as none, a head it lacks (the chunked loss of a model whose
        head is not fitgpt's) as the plain one."""
        plan, exact = cls.from_policy(spec, profile.n_blocks)
        options = tuple(o if o in profile.blocks[0] else "none" for o in plan.blocks)
        head = plan.head if plan.head in profile.heads else "plain"
        return cls(options, head), exact and (options, head) == (plan.blocks, plan.head)


@dataclass(frozen=True)
class Prediction:
    peak: int
    where: str
    """The segment of the step where the peak falls."""
    params: int
    optimizer: int
    grads: int
    """Gradient bytes alive at the peak."""
    activations: int
    """Saved activation bytes alive at the peak."""
    temporaries: int
    """Workspace of the segment at the peak (recompute, backward temporaries)."""
    activations_end_of_forward: int
    recompute_flops: int
    step_flops: int
    step_time: float = 0.0
    """Predicted seconds of the step (every micro-batch and the optimizer step); 0 without a cost model."""
    none_time: float = 0.0
    """The same without checkpointing, for the ratio."""

    @property
    def flops_ratio(self) -> float:
        return (self.step_flops + self.recompute_flops) / self.step_flops

    @property
    def time_ratio(self) -> float | None:
        return self.step_time / self.none_time if self.none_time else None

    def breakdown(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "temporaries": self.temporaries}


def predict(profile: StepProfile, plan: Plan) -> Prediction:
    """The peak of one micro-batch and optimizer step under ``plan``, by category at the peak."""
    p = profile
    if len(plan.blocks) != p.n_blocks:
        raise ValueError(f"the plan has {len(plan.blocks)} block options, the model {p.n_blocks} blocks")
    head = p.heads[plan.head]
    events: list[tuple[int, str, int, int, int]] = []  # (total, where, activations, grads, temporaries)
    holder = _first_recompute(plan.blocks)
    shared = p.shared_inputs if holder is not None else 0  # held from the forward's end to the holder's backward

    def event(where: str, level: int, rise: int, activations: int) -> None:
        events.append((level + rise, where, activations, level - activations, rise))

    level = 0
    event("embed forward", 0, p.embed_fwd_rise, 0)
    level += p.embed_saved
    for i, o in enumerate(plan.blocks):
        event(f"block {i} forward", level, p.blocks[i][o].fwd_rise, level)
        level += p.blocks[i][o].saved + p.blocks[i][o].transient
    event("head forward", level, head.fwd_rise + shared, level)
    level += head.saved - sum(p.blocks[i][o].transient for i, o in enumerate(plan.blocks)) + shared  # autocast's cache let go
    end_of_forward = level
    event("head backward", level, head.bwd_rise, level)
    level += head.bwd_delta
    saved_prefix = p.embed_saved + sum(p.blocks[i][o].saved for i, o in enumerate(plan.blocks)) + shared
    for i in reversed(range(p.n_blocks)):
        o = plan.blocks[i]
        event(f"block {i} backward", level, p.blocks[i][o].bwd_rise, saved_prefix)
        released = shared if i == holder else 0
        saved_prefix -= p.blocks[i][o].saved + released
        level += p.block_grads[i] - p.blocks[i][o].saved - released
    event("embed backward", level, p.embed_bwd_rise, p.embed_saved)
    level += p.embed_bwd_delta
    event("optimizer step", level, p.optimizer_rise, 0)
    total, where, activations, grads, temporaries = max(events)
    held_grads = p.baseline - p.params - p.optimizer
    return Prediction(
        peak=p.baseline + total, where=where, params=p.params, optimizer=p.optimizer, grads=held_grads + grads,
        activations=activations, temporaries=temporaries, activations_end_of_forward=end_of_forward,
        recompute_flops=_cost(p, plan)[1], step_flops=p.step_flops, step_time=step_time(p, plan),
        none_time=step_time(p, Plan.uniform(p.n_blocks, "none")),
    )


_HOLD_INPUTS = ("pointwise", "selective", "torchtitan", "block")
"""Options that run their block under a checkpoint, which keeps the block's inputs until its backward."""


def _first_recompute(blocks: tuple[str, ...]) -> int | None:
    """The first block whose checkpoint holds the shared inputs (the last to let them go), or None."""
    return next((i for i, o in enumerate(blocks) if o in _HOLD_INPUTS), None)


def step_time(profile: StepProfile, plan: Plan) -> float:
    """Predicted seconds of a step under ``plan``: each micro-batch's segments (twice where the step in the backward
    clips: the first pass counted as the second, its optimizer steps included), then the optimizer step."""
    micro = profile.passes * (profile.embed_time + _cost(profile, plan)[0])
    return profile.grad_accum * micro + profile.optimizer_time


def _cost(profile: StepProfile, plan: Plan) -> tuple[float, int, int]:
    """(seconds of the blocks and head per micro-batch, recomputed FLOPs, options that recompute): the solver's order."""
    head = profile.heads[plan.head]
    chosen = [profile.blocks[i][o] for i, o in enumerate(plan.blocks)]
    return (head.time + sum(b.time for b in chosen), head.recompute_flops + sum(b.recompute_flops for b in chosen),
            sum(o != "none" for o in plan.blocks) + (plan.head != "plain"))


def _pareto(states: dict[tuple[int, int], tuple]) -> list[tuple]:
    """The (s, u, cost, options) no other state beats on s, u and cost at once."""
    front, us, costs = [], [], []  # a staircase of kept (u, cost): u rising, cost falling
    for (s, u), (cost, opts) in sorted(states.items()):  # s rising: every earlier state has s' <= s
        j = bisect.bisect_right(us, u) - 1
        if j >= 0 and costs[j] <= cost:
            continue
        front.append((s, u, cost, opts))
        k = bisect.bisect_left(us, u)
        end = k
        while end < len(us) and costs[end] >= cost:
            end += 1
        us[k:end], costs[k:end] = [u], [cost]
    return front


def _solve_head(p: StepProfile, head_name: str, room: int) -> tuple[tuple[float, int, int], tuple[str, ...]] | None:
    """Cheapest block options with this head within ``room`` bytes above the baseline, or None."""
    head = p.heads[head_name]
    c_head = p.embed_saved + head.saved + head.bwd_delta  # the level after the head's backward, less S(N)
    grads_after = [sum(p.block_grads[i + 1 :]) for i in range(p.n_blocks)]
    grads_all = sum(p.block_grads)
    if max(p.embed_fwd_rise, c_head + grads_all + p.embed_bwd_rise,
           c_head + grads_all + p.embed_bwd_delta + p.optimizer_rise) > room:
        return None
    # state: (bytes saved for backward, bytes held in the forward, cost, options), the latter also holding
    # autocast's transient copies; pruned to the states no other beats on all three. Kept apart by the shared inputs
    # they hold (0, or all of them once an option recomputes a block: through the head's backward and the backward
    # of every block from there on). Seconds are summed in whole nanoseconds: plans of equal cost (middle blocks are
    # alike) tie exactly, not by floating-point rounding, and the first found is kept. That gives runs of blocks with
    # one option rather than a scatter, and the allocator replay records a run at a fraction of its depth.
    nanoseconds = [{o: round(b.time * 1e9) for o, b in options.items()} for options in p.blocks]
    states: dict[int, list[tuple[int, int, tuple, tuple[str, ...]]]] = {0: [(p.embed_saved, p.embed_saved, (0, 0, 0), ())]}
    for i in range(p.n_blocks):
        nxt: dict[int, dict[tuple[int, int], tuple[tuple, tuple[str, ...]]]] = {}
        for held_before, group in states.items():
            for s, u, cost, opts in group:
                for o, b in p.blocks[i].items():
                    held = p.shared_inputs if o in _HOLD_INPUTS else held_before
                    if u + b.fwd_rise > room or c_head - p.embed_saved + grads_after[i] + s + held + b.saved + b.bwd_rise > room:
                        continue
                    key, c2 = (s + b.saved, u + b.saved + b.transient), (cost[0] + nanoseconds[i][o], cost[1] + b.recompute_flops,
                                                                         cost[2] + (o != "none"))
                    reached = nxt.setdefault(held, {})
                    if key not in reached or c2 < reached[key][0]:
                        reached[key] = (c2, opts + (o,))
        states = {held: _pareto(reached) for held, reached in nxt.items()}
    done = [(cost, opts) for held, group in states.items() for s, u, cost, opts in group
            if u + head.fwd_rise + held <= room and s + head.saved + held + head.bwd_rise <= room]
    if not done:
        return None
    cost, opts = min(done)
    return (cost[0] / 1e9 + head.time, cost[1] + head.recompute_flops, cost[2] + (head_name != "plain")), opts


def _cheapest_options(p: StepProfile, head_name: str) -> tuple[tuple[float, int, int], tuple[str, ...]]:
    """Each block's cheapest option with this head, and that plan's cost: no plan with this head costs less (costs add
    up block by block). Where it fits it is the answer, found in one prediction: with room to spare (a deep model's
    depth probed under a large budget) the search over plans, whose fronts grow with the depth, takes minutes."""
    opts = tuple(min(b, key=lambda o: (b[o].time, b[o].recompute_flops, o != "none")) for b in p.blocks)
    return _cost(p, Plan(opts, head_name)), opts


def _cheapest(profile: StepProfile, budget: int) -> Plan | None:
    room = budget - profile.baseline
    found = []  # (cost, the head's place in the profile, plan): ties go to the earlier head
    bounds = sorted((*_cheapest_options(profile, head), i, head) for i, head in enumerate(profile.heads))
    for bound, opts, i, head in bounds:
        if found and bound > min(found)[0]:
            break  # no plan with this head, or any later one, can cost less than one found
        if predict(profile, Plan(opts, head)).peak <= budget:
            r = (bound, opts)
        else:
            r = _solve_head(profile, head, room) if room >= 0 else None
        if r is not None:
            found.append((r[0], i, Plan(r[1], head)))
    return min(found)[2] if found else None


def solve(profile: StepProfile, budget: int) -> tuple[Plan, Prediction]:
    """The fastest plan (least recompute without a cost model) whose predicted peak is within ``budget`` bytes."""
    plan = _cheapest(profile, budget)
    if plan is None:
        raise PlanError(_no_fit_message(profile, budget))
    return plan, predict(profile, plan)


def solve_exhaustive(profile: StepProfile, budget: int) -> tuple[Plan, Prediction] | None:
    """Try every plan (options^N x 2): the reference the dynamic programme is tested against."""
    best = None
    for opts in itertools.product(list(profile.blocks[0]), repeat=profile.n_blocks):
        for head in profile.heads:
            plan = Plan(opts, head)
            pred = predict(profile, plan)
            if pred.peak <= budget and (best is None or _cost(profile, plan) < best[0]):
                best = (_cost(profile, plan), plan, pred)
    return None if best is None else best[1:]


def min_peak(profile: StepProfile) -> tuple[Plan, Prediction]:
    """The plan with the lowest predicted peak (the most aggressive one that exists)."""
    candidates = [Plan.uniform(profile.n_blocks, o, h) for o in profile.blocks[0] for h in profile.heads]
    # The best uniform plan bounds it from above; a mixed plan can be lower (block recompute has the
    # larger backward workspace). Bisect on the budget, each probe an exact solve; hi always fits.
    hi, lo = min(predict(profile, c).peak for c in candidates), profile.baseline
    while hi - lo > max(1, hi // 10_000):
        mid = (lo + hi) // 2
        if _cheapest(profile, mid) is not None:
            hi = mid
        else:
            lo = mid + 1
    return solve(profile, hi)


def _optimizer_advice(p: StepProfile) -> str:
    """The optimizer settings that would shrink the fixed costs and are not in use (read from the bytes they hold)."""
    knobs = []
    if p.grads >= p.params and not p.persistent_grads:
        knobs.append(f"--optim.in-backward --optim.grad-clip 0 (each gradient freed as it is applied: about "
                     f"{format_bytes(p.grads)} less)")
    if p.optimizer > 1.5 * p.params:  # fp32 moments: 8 bytes a 4-byte parameter
        knobs.append(f"--optim.state-dtype bf16 (moments in bf16: {format_bytes(p.optimizer // 2)} less)")
    if p.device == "cuda" and not p.host and p.optimizer > 0.5 * p.params:
        knobs.append(f"--optim.offload (the optimizer state on the host: {format_bytes(p.optimizer)} less on the card)")
    return f"Keep less per parameter with {' and '.join(knobs)}. " if knobs else ""


def _no_fit_message(p: StepProfile, budget: int) -> str:
    # Fixed costs first: what no checkpointing policy can touch.
    fixed = p.params + p.grads + p.optimizer
    lines = [f"nothing fits in {format_bytes(budget)} at batch {p.batch_size} x context {p.context}."]
    if fixed >= budget:
        lines.append(
            f"Parameters ({format_bytes(p.params)}), gradients ({format_bytes(p.grads)}) and AdamW state "
            f"({format_bytes(p.optimizer)}) alone take {format_bytes(fixed)}, {format_bytes(fixed - budget)} over: "
            "no checkpointing can help. " + _optimizer_advice(p)
            + "Use fewer blocks (--model.n-blocks), a narrower model (--model.n-embed), "
            + (f"or shard them over more than {p.fsdp_ranks} GPUs (--world-size)." if p.fsdp_ranks > 1
               else "or shard the weights over GPUs (--parallel fsdp).")
        )
        return " ".join(lines)
    plan, pred = min_peak(p)
    over = pred.peak - budget
    act = pred.peak - fixed
    room = budget - fixed
    lines.append(
        f"The most aggressive plan ({plan.spec()}) needs {format_bytes(pred.peak)}, {format_bytes(over)} over "
        f"(parameters + gradients + AdamW state: {format_bytes(fixed)}; activations and workspace at the peak, "
        f"in the {pred.where}: {format_bytes(act)})."
    )
    scale = room / act
    knobs = []
    if p.batch_size > 1:
        b = max(1, int(p.batch_size * scale))
        knobs.append(f"a smaller batch (about --batch-size {b}, with --grad-accum to keep the tokens per step)")
    knobs.append(f"a shorter context (about --context {max(1, int(p.context * scale))})")
    knobs.append("fewer blocks (--model.n-blocks; a Hugging Face config's num_hidden_layers)")
    lines.append("To fit, try " + "; or ".join(knobs) + ".")
    return " ".join(lines)
