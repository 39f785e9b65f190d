"""The model a time budget buys: for each depth of one family of shapes (`fitgpt.scaling.family`), its fastest
configuration that fits the memory budget (as ``fit`` searches it), the tokens it trains in the time at the predicted
tokens per second, and the loss a scaling law predicts for them. The pick is the row of least predicted loss.

The law is the user's own (``fitgpt ladder``: fitted on their data and tokenizer, with its bootstrap interval), or,
without one, Hoffmann et al.'s (2022) published coefficients, measured on another corpus and tokenizer: every loss
is then marked as theirs, and only the ranking of the rows means anything."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fitgpt.config import TrainConfig
from fitgpt.errors import UserError
from fitgpt.estimate.source import OwnModel, param_count
from fitgpt.estimate.throughput import Throughput, measure_throughput
from fitgpt.estimate.workload import Workload
from fitgpt.plan.fastest import Choice, fastest
from fitgpt.scaling.family import NANOCHAT, Family, compute_params, non_embedding_params, warmup_for
from fitgpt.scaling.law import Coefficients, Law, effective_tokens

PUBLISHED = Coefficients(E=1.69, A=406.4, alpha=0.34, B=410.7, beta=0.28)
"""Hoffmann et al. (2022), approach 3: MassiveText, a SentencePiece vocabulary of 32,000, total parameters."""
STARTUP_SECONDS = 5.0
"""A run's time before its first step (the interpreter and torch, the data, the model, the first evaluation's
batches): measured about 4 s for the tiny preset on this project's 2-core CPU."""
DEPTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 128)
"""The family's depths searched: every one up to 8, then about 1.2x apart (parameters about 1.7x)."""
SPAN = 8.0
"""Rows are shown from 1/SPAN to SPAN times the pick's parameters (at least)."""


@dataclass
class Row:
    depth: int
    n_params: int
    """Non-embedding parameters, as the law counts them."""
    total_params: int
    choice: Choice
    tokens: int
    epochs: float
    loss: float
    low: float
    high: float
    train: TrainConfig
    modelled_tokens_per_s: float
    """The per-op time model's tokens/s (where the step was timed for real, beside it)."""
    timed: Throughput | None = None
    """The step timed for real on the device at hand (its spread, and how long the timing took); None: modelled."""
    flops: float = 0.0
    """6 x its compute parameters x its tokens: what it spends, beside the law's points'."""
    width: int = 0

    def as_json(self, command: str) -> dict:
        c = self.choice
        return {"depth": self.depth, "params": self.n_params, "total_params": self.total_params, "tokens": self.tokens,
                "epochs": self.epochs, "tokens_per_s": c.tokens_per_s,
                "modelled_tokens_per_s": self.modelled_tokens_per_s, "micro_batch": c.micro_batch,
                "grad_accum": c.grad_accum, "precision": c.precision, "parallel": c.layout.name, "policy": c.policy,
                "predicted_peak": c.peak, "predicted_loss": self.loss, "loss_low": self.low, "loss_high": self.high,
                "tokens_per_s_spread": self.timed and self.timed.spread, "timed_seconds": self.timed and self.timed.seconds,
                "flops": self.flops, "command": command}


def usable_seconds(seconds: float, train: TrainConfig) -> float:
    """Of a run of --time-budget ``seconds``: the time its steps get, after its start-up and its evaluations (each
    of eval_batches forward passes, a third of a step each, every eval_interval steps)."""
    evals = train.eval_batches / (3 * train.grad_accum * train.eval_interval)
    return max(0.0, seconds - STARTUP_SECONDS) / (1 + evals)


def predicted(law: Law | None, n: float, tokens: float, unique: float) -> tuple[float, float, float]:
    if law is not None:  # on the data the rows train on (--unique-tokens, or --data.dir's), not the law's own
        return law.predict(n, tokens, unique)
    loss = float(PUBLISHED.loss(n, effective_tokens(tokens, unique)))
    return loss, loss, loss


def budget_row(w: Workload, depth: int, memory: int, seconds: float, law: Law | None, unique: float,
               here: torch.device | None = None, family: Family = NANOCHAT) -> Row | None:
    """Depth ``depth``'s row of ``family`` (the law's), or None where no configuration of it fits ``memory``.
    ``here``: the device at hand, on which the chosen configuration's step is timed for real (`measure_throughput`);
    otherwise (a card named) its tokens/s are the time model's."""
    model = family.shape(depth, w.train.model)
    wd = w.vary(model=model)
    result = fastest(wd, memory, top=1)
    if not result["choices"]:
        return None
    c = result["choices"][0]
    modelled, timed = c.tokens_per_s, None
    if here is not None:
        timed = measure_throughput(c.config(wd.train), here)
        c = dataclasses.replace(c, compute_seconds=c.tokens / timed.tokens_per_s, link_seconds=0.0)
    tokens = int(c.tokens_per_s * usable_seconds(seconds, w.train))
    n = non_embedding_params(model)
    loss, low, high = predicted(law, n, tokens, unique)
    steps = tokens // max(1, c.tokens)
    optim = dataclasses.replace(w.train.optim, schedule="wsd", warmup_steps=warmup_for(w.train.optim.warmup_steps, steps))
    train = dataclasses.replace(c.config(wd.train), optim=optim, time_budget=None)
    return Row(depth, n, param_count(OwnModel(model)), c, tokens, tokens / unique, loss, low, high, train, modelled, timed,
               6.0 * compute_params(model) * tokens, family.width(depth))


def budget_rows(w: Workload, memory: int, seconds: float, law: Law | None, unique: float,
                here: torch.device | None = None) -> tuple[list[Row], int]:
    """The rows from the smallest depth up, until one of SPAN times the best's parameters or more predicts a higher
    loss (or nothing larger fits): every row from 1/SPAN to SPAN times the pick's parameters, and the pick's index."""
    if usable_seconds(seconds, w.train) <= 0:
        raise UserError(f"--time-budget {seconds:.0f}s is spent before a run's first step (its start-up: about "
                        f"{STARTUP_SECONDS:.0f}s): give it more time")
    rows: list[Row] = []
    family = Family.of_recipe(law.recipe) if law is not None else NANOCHAT
    for depth in DEPTHS:
        row = budget_row(w, depth, memory, seconds, law, unique, here, family)
        if row is None or row.tokens < row.choice.tokens:  # it does not fit, or trains not one step in the time
            break
        rows.append(row)
        best = min(rows, key=lambda r: r.loss)
        if row.n_params >= SPAN * best.n_params and row.loss > best.loss:
            break
    if not rows:
        return [], 0
    best = min(rows, key=lambda r: r.loss)
    return rows, rows.index(best)
