"""A scaling law fitted on a ladder's own points: the final loss L of a model of N parameters trained on D tokens,

    L(N, D) = E + A / N^alpha + B / D'^beta

Hoffmann et al.'s (2022) approach 3, fitted as they and Besiroglu et al. (2024) fit it: the Huber loss (delta 1e-3)
of log L against the log-sum-exp form, minimised by L-BFGS from a grid of starts, with bootstrap resamples of the
points for its uncertainty. N counts the parameters outside the embeddings (the blocks and the final norm: Kaplan et
al. 2020 find the law cleaner without them, and at the ladder's sizes the tables are most of the model). D' is the
tokens counted for repeated data (Muennighoff et al. 2023): past one epoch of U unique tokens, the repeats are worth
U R* (1 - exp(-R / R*)) more, R the repeats and R* = 15.4.

A law is data: the coefficients beside the points and residuals they come from, and the tokenizer and vocabulary of
the data they were measured on, written as JSON and read back with every field checked (nothing in it runs).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fitgpt.errors import UserError

FORM = "L = E + A / N^alpha + B / D^beta"
R_STAR = 15.4
"""Muennighoff et al. (2023): the number of repeats after which repeated data's worth has decayed by 1/e."""
HUBER_DELTA = 1e-3
EXPONENT_BOUNDS = (0.01, 3.0)
VERSION = 1


def effective_tokens(tokens: float, unique: float) -> float:
    """Tokens trained on, counted for repeats of ``unique`` tokens of data (Muennighoff et al. 2023)."""
    if tokens <= unique:
        return float(tokens)
    repeats = tokens / unique - 1
    return float(unique + unique * R_STAR * (1 - math.exp(-repeats / R_STAR)))


@dataclass(frozen=True)
class Coefficients:
    E: float
    A: float
    alpha: float
    B: float
    beta: float

    def loss(self, n, d):
        """The predicted loss of ``n`` parameters on ``d`` effective tokens (scalars or arrays)."""
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    def optimal_params(self, flops: float) -> float:
        """The N that minimises the loss at ``flops`` = 6 N D (Hoffmann et al.'s closed form)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / (self.alpha + self.beta))
        return g * (flops / 6) ** (self.beta / (self.alpha + self.beta))


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray) -> tuple[float, np.ndarray]:
    """The Huber loss of log L against log(exp(a - alpha log N) + exp(b - beta log D) + exp(e)), and its gradient in
    theta = (a, b, e, alpha, beta)."""
    a, b, e, alpha, beta = theta
    terms = np.stack([a - alpha * log_n, b - beta * log_d, np.full_like(log_n, e)])  # (3, points)
    pred = np.logaddexp.reduce(terms, axis=0)
    w = np.exp(terms - pred)  # each term's share of the sum: d pred / d term
    r = pred - log_l
    small = np.abs(r) <= HUBER_DELTA
    value = np.sum(np.where(small, 0.5 * r**2, HUBER_DELTA * (np.abs(r) - 0.5 * HUBER_DELTA)))
    slope = np.where(small, r, HUBER_DELTA * np.sign(r))
    grad = np.array([slope @ w[0], slope @ w[1], slope @ w[2], -slope @ (w[0] * log_n), -slope @ (w[1] * log_d)])
    return float(value), grad


TOP_STARTS = 8
"""The law's own fit descends from the starts of the grid where the objective is lowest, each to convergence
(`CONVERGED`): the best 8 of Hoffmann et al.'s 243 found the whole grid's minimum on each of five ladders' points and
20 resamples (RESULTS, issue 68), in a twentieth of the time. Under load the whole grid took longer than a ladder's
reserve for its fit."""
CONVERGED = {"gtol": 1e-12, "ftol": 1e-15, "maxiter": 5000}
"""L-BFGS-B run to convergence: the objective is about 1e-4 at a fit, and scipy's default gradient tolerance (1e-5)
stops a descent early, near where it started. The bootstrap's refits keep the defaults: they start from the fit,
and converged, each took 1.5 s here (some resamples leave an exponent free), 200 of them longer than any ladder."""


def _fit(n: np.ndarray, d: np.ndarray, loss: np.ndarray, starts: list, converge: bool = False) -> Coefficients:
    """The coefficients from the best of ``starts``' descents; ``converge``: the law's own fit (the best TOP_STARTS
    starts, each descended to convergence), else a bootstrap refit."""
    from scipy.optimize import minimize

    args = (np.log(n), np.log(d), np.log(loss))
    bounds = [(-10, 40), (-10, 40), (-5, math.log(loss.min())), EXPONENT_BOUNDS, EXPONENT_BOUNDS]
    if converge:
        starts = sorted(starts, key=lambda s: _objective(np.array(s, dtype=float), *args)[0])[:TOP_STARTS]
    best = min((minimize(_objective, np.array(s, dtype=float), args=args, jac=True, method="L-BFGS-B", bounds=bounds,
                         options=CONVERGED if converge else None) for s in starts), key=lambda r: r.fun)
    a, b, e, alpha, beta = (float(x) for x in best.x)
    return Coefficients(E=math.exp(e), A=math.exp(a), alpha=alpha, B=math.exp(b), beta=beta)


def _grid(min_loss: float) -> list:
    """Starts for the fit: a grid as Hoffmann et al.'s, over this scale's ranges (E below the lowest loss)."""
    e0 = math.log(min_loss)
    return [list(x) for x in itertools.product((0.0, 5.0, 10.0), (0.0, 5.0, 10.0), (e0 - 1.5, e0 - 0.5, e0 - 0.1),
                                               (0.2, 0.5, 1.0), (0.2, 0.5, 1.0))]


@dataclass
class Law:
    """A fitted law, with its evidence."""

    coefficients: Coefficients
    points: list[dict]
    """Each measured point: n_params, tokens, effective_tokens, val_loss, and how it was made (depth, run)."""
    residuals: list[float]
    """log(measured) - log(predicted) per point."""
    bootstrap: list[Coefficients]
    """The law refitted on resampled points: its spread is the law's uncertainty."""
    data: dict
    """What it was fitted on: tokenizer_sha256, vocab_size, unique_tokens, dir."""
    recipe: dict = field(default_factory=dict)
    """How the points were trained: the family's shape rule, batch, context, schedule, optimizer."""
    iso_flop: dict = field(default_factory=dict)
    """Hoffmann et al.'s approach 2 on the same points, beside this law's optimum (`fitgpt.scaling.isoflop`)."""

    def problems(self) -> list[str]:
        """Why these coefficients are not a law the points identify (none: they are): an irreducible loss at zero or
        at the best measured loss, an exponent on its bound (the fit ran into the box, the points left it free)."""
        c, best = self.coefficients, min(p["val_loss"] for p in self.points)
        out = [f"E {c.E:.3g} at zero"] if c.E < 0.01 * best else []
        out += [f"E {c.E:.3f} at the best measured loss {best:.3f}"] if c.E > 0.995 * best else []
        for name, value in (("alpha", c.alpha), ("beta", c.beta)):
            if not EXPONENT_BOUNDS[0] * 1.1 < value < EXPONENT_BOUNDS[1] * 0.99:
                out.append(f"{name} {value:.3f} on its bound")
        return out

    def compute_range(self) -> tuple[float, float]:
        """The least and most FLOPs among the points (6 x N x D where a point does not say)."""
        flops = [p.get("flops") or 6.0 * p["n_params"] * p["tokens"] for p in self.points]
        return min(flops), max(flops)

    def predict(self, n: float, tokens: float, unique: float | None = None) -> tuple[float, float, float]:
        """(loss, low, high): the law's loss for ``n`` parameters trained on ``tokens`` of data of ``unique`` tokens
        (default: the law's own data), repeats counted, and the 5th and 95th percentiles of the bootstrap laws'."""
        d = effective_tokens(tokens, self.data["unique_tokens"] if unique is None else unique)
        spread = [float(c.loss(n, d)) for c in self.bootstrap] or [float(self.coefficients.loss(n, d))]
        return float(self.coefficients.loss(n, d)), float(np.percentile(spread, 5)), float(np.percentile(spread, 95))

    @property
    def rms_residual(self) -> float:
        return float(np.sqrt(np.mean(np.square(self.residuals)))) if self.residuals else 0.0

    def to_json(self) -> dict:
        return {"version": VERSION, "form": FORM, "coefficients": asdict(self.coefficients),
                "bootstrap": [asdict(c) for c in self.bootstrap], "points": self.points, "residuals": self.residuals,
                "rms_log_residual": self.rms_residual, "data": self.data, "recipe": self.recipe, "iso_flop": self.iso_flop,
                "param_count": "non-embedding (the blocks and the final norm)",
                "repeated_data": f"Muennighoff et al. 2023, R* = {R_STAR}"}

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1))


MIN_RESAMPLES = 20
"""Bootstrap refits a law is given whatever its deadline: enough for a 5th to 95th percentile interval."""


def fit_law(points: list[dict], data: dict, recipe: dict, resamples: int = 200, seed: int = 0,
            deadline: float | None = None, clock: Callable[[], float] = time.perf_counter) -> Law:
    """The law through ``points`` (each with n_params, tokens and val_loss; effective tokens counted here), with
    ``resamples`` bootstrap refits (each from the full fit and a few of the grid's starts), as many of them as end
    before ``deadline`` (on ``clock``), MIN_RESAMPLES at the least."""
    if len(points) < 6:
        raise UserError(f"a law of five coefficients needs at least 6 points, the ladder measured {len(points)}: give "
                        "it a larger --time-budget")
    pts = [{**p, "effective_tokens": effective_tokens(p["tokens"], data["unique_tokens"])} for p in points]
    n = np.array([p["n_params"] for p in pts], dtype=float)
    d = np.array([p["effective_tokens"] for p in pts], dtype=float)
    loss = np.array([p["val_loss"] for p in pts], dtype=float)
    grid = _grid(float(loss.min()))
    best = _fit(n, d, loss, grid, converge=True)
    theta = [math.log(best.A), math.log(best.B), math.log(best.E), best.alpha, best.beta]
    rng = np.random.default_rng(seed)
    boot = []
    for _ in range(resamples):
        if deadline is not None and len(boot) >= MIN_RESAMPLES and clock() > deadline:
            break
        i = rng.integers(0, len(pts), len(pts))
        if len(set(n[i])) < 2 or len(set(d[i])) < 2:
            continue
        starts = [theta] + [grid[j] for j in rng.choice(len(grid), 4, replace=False)]
        boot.append(_fit(n[i], d[i], loss[i], starts))
    residuals = [float(x) for x in np.log(loss) - np.log(best.loss(n, d))]
    return Law(best, pts, residuals, boot, data, recipe)


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where} is not a finite number")
    return float(value)


def _coefficients(d, where: str) -> Coefficients:
    if not isinstance(d, dict) or set(d) != {"E", "A", "alpha", "B", "beta"}:
        raise ValueError(f"{where} must hold E, A, alpha, B and beta")
    c = Coefficients(**{k: _number(v, f"{where}.{k}") for k, v in d.items()})
    if min(c.A, c.B, c.alpha, c.beta) <= 0 or c.E < 0:
        raise ValueError(f"{where}: A, B, alpha and beta must be positive and E not negative")
    return c


def read_law(path: str | Path, flag: str = "--law") -> Law:
    """The law in ``path``, every field checked (JSON only: nothing in it runs); a one-line UserError naming the
    file and what is wrong otherwise."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
        if not isinstance(raw, dict) or raw.get("version") != VERSION or raw.get("form") != FORM:
            raise ValueError(f"not a law file of this fitgpt (version {VERSION}, form {FORM!r})")
        coefficients = _coefficients(raw.get("coefficients"), "coefficients")
        boot = raw.get("bootstrap")
        if not isinstance(boot, list):
            raise ValueError("bootstrap must be a list")
        bootstrap = [_coefficients(c, f"bootstrap[{i}]") for i, c in enumerate(boot)]
        data = raw.get("data")
        if not isinstance(data, dict) or not isinstance(data.get("tokenizer_sha256"), str):
            raise ValueError("data must name the tokenizer it was fitted on (tokenizer_sha256)")
        for key in ("vocab_size", "unique_tokens"):
            if _number(data.get(key), f"data.{key}") <= 0:
                raise ValueError(f"data.{key} must be positive")
        points, residuals = raw.get("points"), raw.get("residuals")
        if not isinstance(points, list) or not isinstance(residuals, list) or len(points) != len(residuals):
            raise ValueError("points and residuals must be lists of one length")
        for i, pt in enumerate(points):
            for key in ("n_params", "tokens", "val_loss"):
                _number(pt.get(key) if isinstance(pt, dict) else None, f"points[{i}].{key}")
        recipe = raw.get("recipe", {})
        if not isinstance(recipe, dict):
            raise ValueError("recipe must be an object")
        if recipe.get("precision", "fp32") not in ("fp32", "bf16", "fp16"):  # the precision fit's rows train in
            raise ValueError(f"recipe.precision must be fp32, bf16 or fp16, got {recipe['precision']!r}")
        if recipe.get("aspect", 64) not in (16, 32, 64, 128) or not isinstance(recipe.get("mup", False), bool):
            raise ValueError("recipe.aspect must be 16, 32, 64 or 128 and recipe.mup true or false")
        iso = raw.get("iso_flop", {})
        if not isinstance(iso, dict):
            raise ValueError("iso_flop must be an object")
    except OSError as e:
        raise UserError(f"{flag} {p}: cannot read it ({e.strerror or e}); write one with fitgpt ladder") from None
    except (ValueError, TypeError, AttributeError) as e:  # json's errors are ValueErrors too
        raise UserError(f"{flag} {p}: not a valid law file ({e}); write one with fitgpt ladder --out {p}") from None
    return Law(coefficients, points, [float(r) for r in residuals], bootstrap, data, recipe, iso)
