"""A profile at a size never profiled, fitted exactly through profiles at other sizes.

Every quantity in a profile is a polynomial of low degree in the batch (bytes and FLOPs are linear in it) and
the context (linear with flash attention, quadratic with the math kernel): Lagrange through as many points
as the degree, plus one, is exact.
"""

from __future__ import annotations

import dataclasses

from fitgpt.estimate.profile import BlockOption, HeadOption, StepProfile


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

    def fitted(values: list):
        v0 = values[0]
        if isinstance(v0, float):  # seconds: linear in the batch, like the bytes
            return max(0.0, _lagrange(xs, values, x))
        if isinstance(v0, bool) or not isinstance(v0, (int, list, dict, BlockOption, HeadOption)):
            return values[-1]
        if isinstance(v0, int):
            return max(0, round(_lagrange(xs, values, x))) if min(values) >= 0 else round(_lagrange(xs, values, x))
        if isinstance(v0, list):
            return [fitted([v[i] for v in values]) for i in range(len(v0))]
        if isinstance(v0, dict):
            return {k: fitted([v[k] for v in values]) for k in v0}
        return type(v0)(**{f.name: fitted([getattr(v, f.name) for v in values]) for f in dataclasses.fields(v0)})

    profiles = [p[1] for p in points]
    kwargs = {f.name: fitted([getattr(p, f.name) for p in profiles]) for f in dataclasses.fields(StepProfile)}
    kwargs[field_name] = x
    return StepProfile(**kwargs)
