"""The ladder's design, from its depths' measured throughputs: which depths the budget trains where the law's form
applies, and each one's share of the time.

Every depth trains to one top compute level (FLOPs = 6 x the parameters a token's compute passes through x tokens,
`family.compute_params`), its cooldown branches to a quarter and a half of it: three compute levels, the same for
every depth, the iso-FLOP profiles of Hoffmann et al.'s approach 2 beside the points of approach 3. A depth is in the
ladder only where each of its points, the quarter branch the least, sees MIN_TOKENS_PER_PARAM tokens a parameter (the
largest depth binds), and the two smallest end saturated (SATURATED_TOKENS_PER_PARAM: the parameter term shows at two
sizes); the depths kept must span MIN_RANGE in parameters, or the budget is refused, saying how much would do. The
points trained are held to the same rules after (`shortfalls`): a machine that slowed after its probes trains less."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fitgpt.errors import UserError
from fitgpt.units import format_duration

MIN_TOKENS_PER_PARAM = 0.5
"""Each point's tokens a parameter at the least: below it a run is still in its early transient, where a larger model
is worse than a smaller one at the same tokens (RESULTS, issue 56's ladder: depth 5 at 0.03 and depth 4 at 0.12 tokens
a parameter ended 12% and 3% off a law the others follow within 1%), which no law decreasing in N can fit."""
SATURATED_TOKENS_PER_PARAM = 100.0
"""The two smallest depths' runs end past this many tokens a parameter: where the parameter term has shown. Measured
here (RESULTS, issue 67): an 8-minute ladder at width 32 a block had depth 1 flatten from 188 to 700 tokens a
parameter (4.37 to 4.19) while depth 2, at 21, still fell 8% from 12 to 21; its fit put alpha on its bound, the
parameter term pinned by one size alone. Two sizes where it shows pin it."""
MIN_RANGE = 10.0
"""The ladder's largest depth's parameters over its smallest's, at the least: a parameter exponent needs a decade."""
LOWEST = 0.25
"""The least of a depth's compute levels, as a share of its run's (its first cooldown branch)."""
REACHED = 0.5
"""A trained point meets a rule where it reached this share of the rule's tokens a parameter: each run ends on the
wall clock, short of the steps its probe planned where the machine slowed. Measured (RESULTS, issue 67): two
28-minute ladders whose second depth ended at 88.6 and 78.4 of its 100 gave laws that agree (alpha 0.552 and 0.544,
each's E inside the other's interval one way, the same pick for 12 minutes); one beside other work, at 24, did not
(E 3.46, beta 1.25, on 8 points)."""


@dataclass(frozen=True)
class Rules:
    min_tokens_per_param: float = MIN_TOKENS_PER_PARAM
    saturated_tokens_per_param: float = SATURATED_TOKENS_PER_PARAM
    min_range: float = MIN_RANGE
    identify: bool = True
    """Refuse a fitted law its points do not identify (`Law.problems`); a test of the ladder's mechanics alone, on
    a simulated machine, turns it off."""


RULES = Rules()


@dataclass(frozen=True)
class Candidate:
    depth: int
    n_params: int
    """Non-embedding parameters: what the law counts."""
    compute_params: int
    """What a token's FLOPs count (the head's matrix too)."""
    tokens_per_s: float

    def seconds(self, flops: float) -> float:
        """The time its steps take to reach ``flops``."""
        return flops / (6 * self.compute_params * self.tokens_per_s)

    def tokens(self, flops: float) -> float:
        return flops / (6 * self.compute_params)


@dataclass(frozen=True)
class Design:
    depths: list[Candidate]
    flops: float
    """The top compute level: every depth's run reaches it, its branches a quarter and a half of it."""

    def share(self, c: Candidate) -> float:
        """``c``'s share of the runs' time."""
        return c.seconds(self.flops) / sum(d.seconds(self.flops) for d in self.depths)


def top_flops(depths: list[Candidate], seconds: float) -> float:
    """The compute level every depth of ``depths`` reaches when their steps take ``seconds`` in all."""
    return seconds / sum(c.seconds(1.0) for c in depths)


def _least_flops(depths: list[Candidate], rules: Rules) -> float:
    """The compute level at which each of ``depths``' lowest points sees the rules' tokens a parameter, and the
    second smallest's run ends saturated (`SATURATED_TOKENS_PER_PARAM`)."""
    least = max(6 * c.compute_params * rules.min_tokens_per_param * c.n_params / LOWEST for c in depths)
    second = sorted(depths, key=lambda c: c.n_params)[1] if len(depths) > 1 else depths[0]
    return max(least, 6 * second.compute_params * rules.saturated_tokens_per_param * second.n_params)


def _fits(depths: list[Candidate], flops: float, rules: Rules) -> bool:
    return flops >= _least_flops(depths, rules) * (1 - 1e-12)


def _needed(depths: list[Candidate], rules: Rules) -> float:
    """The steps' seconds ``depths`` need for the rules' tokens a parameter."""
    flops = _least_flops(depths, rules)
    return sum(c.seconds(flops) for c in depths)


def plan(probe: Callable[[int], Candidate], depths: list[int], seconds: float, to_budget: Callable[[float], float],
         rules: Rules = RULES, hint: str = "") -> Design:
    """The design for ``seconds`` of steps over the smallest of ``depths`` up, each depth probed (``probe``) only
    where the ones below it all fit: as many depths as fit the rules. Refused (UserError) where those span less than
    the rules' range, naming the --time-budget (``to_budget``: steps' seconds -> a ladder's budget) that would do
    (and ``hint``, another way)."""
    order = sorted(depths)
    probed = [probe(order[0])]
    kept: list[Candidate] = probed[:1]
    for depth in order[1:]:
        probed.append(probe(depth))
        if not _fits(probed, top_flops(probed, seconds), rules):
            break
        kept = list(probed)
    if kept[-1].n_params >= rules.min_range * kept[0].n_params:
        return Design(kept, top_flops(kept, seconds))
    # The least prefix that spans the range: probe on until it does, then say what it needs.
    while probed[-1].n_params < rules.min_range * probed[0].n_params and len(probed) < len(order):
        probed.append(probe(order[len(probed)]))
    span = probed[-1].n_params / probed[0].n_params
    if span < rules.min_range:
        raise UserError(f"--depths {' '.join(map(str, order))} span {span:.1f}x in parameters; a law needs "
                        f"{rules.min_range:g}x: add larger --depths")
    need = to_budget(_needed(probed, rules))
    raise UserError(f"this budget cannot identify a law: past depth {kept[-1].depth} ({kept[-1].n_params / kept[0].n_params:.1f}x "
                    f"depth {kept[0].depth}'s parameters, a law needs {rules.min_range:g}x) its points would see under "
                    f"{rules.min_tokens_per_param:g} tokens a parameter, or its second depth under "
                    f"{rules.saturated_tokens_per_param:g} at its end: depths {probed[0].depth} to {probed[-1].depth} "
                    f"need --time-budget {format_duration(need)} at the throughput measured now{hint}")


def shortfalls(points: list[dict], rules: Rules = RULES) -> list[str]:
    """Where the trained ``points`` (each with its depth, non-embedding parameters, tokens and how it ended) fell
    short of the rules the design planned them to meet (by REACHED): a machine slower than its probes said. The law
    such points give is not the design's (beside other work, a 28-minute ladder's second depth ended at 24 tokens a
    parameter, not 100, and its law's E moved from 2.90 to 3.46, its beta from 0.58 to 1.25)."""
    def ratio(p: dict) -> float:
        return p["tokens"] / p["n_params"]

    out = []
    least = min(points, key=ratio)
    if ratio(least) < REACHED * rules.min_tokens_per_param:
        out.append(f"depth {least['depth']}'s {least['how']} at {ratio(least):.2g} tokens a parameter, under the "
                   f"design's {rules.min_tokens_per_param:g}")
    ends = sorted((p for p in points if p["how"] == "end"), key=lambda p: p["n_params"])
    if len(ends) > 1 and ratio(ends[1]) < REACHED * rules.saturated_tokens_per_param:
        out.append(f"depth {ends[1]['depth']} ended at {ratio(ends[1]):.3g} tokens a parameter, under the design's "
                   f"{rules.saturated_tokens_per_param:g}")
    return out
