"""How long a run is: --max-steps, or --time-budget. A run of a time budget does not know its number of steps: after
each step it asks whether another still fits before the deadline with the run's last evaluation and checkpoint after
it, each timed as the run goes; its learning-rate schedule runs over the share spent of the time its steps get (the
budget less that reserve for the end), so that its cooldown ends with its last step."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from fitgpt.config import TrainConfig
from fitgpt.optim import lr_at
from fitgpt.train import distributed as dist_utils

SAVE_BYTES_PER_S = 200e6
"""Assumed until the first save is timed: what a checkpoint writes per second (hashed, then renamed into place)."""


@dataclass
class StepBudget:
    """A run of --max-steps."""

    max_steps: int
    clock: Callable[[], float] = time.perf_counter
    """What the run's evaluations and saves are timed by (as a Deadline's)."""

    def lr(self, step: int, cfg: TrainConfig) -> float:
        return lr_at(step, cfg.optim, self.max_steps)

    def last(self, step: int) -> bool:
        """Whether ``step`` steps done end the run."""
        return step >= self.max_steps

    def spent(self) -> float | None:
        return None

    def spent_now(self) -> float | None:
        return None

    def timed(self, what: str, seconds: float) -> None:
        pass


@dataclass
class Deadline:
    """A run of --time-budget: ``budget`` seconds, of which ``spent_before`` were spent before this process took the
    run over (a resumed run's), counted from ``started`` (`time.perf_counter`, as `train` began: the data, the model
    and its compilation count too). Under torchrun the ranks agree on the largest of their clocks."""

    budget: float
    spent_before: float
    started: float
    info: dist_utils.DistInfo
    device: torch.device
    eval_steps: float
    """An evaluation's time in steps, until one is timed: its forward passes at a third of a step each."""
    save_seconds: float
    """A checkpoint's time: estimated from its bytes until one is timed."""
    eval_seconds: float | None = None
    step_seconds: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    _agreed: float = field(default=0.0, init=False)
    _reserve: float = field(default=0.0, init=False)
    """The last evaluation's and checkpoint's seconds, as the ranks last agreed."""
    _last_step_end: float | None = field(default=None, init=False)

    def __post_init__(self) -> None:  # made on every rank at one point of `train`: the ranks agree from the first step
        self._agreed, self._reserve = dist_utils.all_max(self.info, [self.spent_now(), self.save_seconds], self.device)

    def spent_now(self) -> float:
        """Seconds of the budget spent by now, on this rank's clock (what a checkpoint records)."""
        return self.spent_before + self.clock() - self.started

    def spent(self) -> float:
        """Seconds of the budget spent, as the ranks last agreed."""
        return self._agreed

    def lr(self, step: int, cfg: TrainConfig) -> float:
        # Over the steps' time, not the budget: a reserve of a fifth of it would otherwise end the run uncooled.
        return lr_at(step, cfg.optim, fraction=self._agreed / max(1e-9, self.budget - self._reserve))

    def last(self, step: int) -> bool:
        """Whether the run ends after this step: another one, then the last evaluation and checkpoint, would not fit."""
        now = self.clock()
        if self._last_step_end is not None:  # the first step (compilation, the allocator's warm-up) is no measure
            seconds = now - self._last_step_end
            self.step_seconds = seconds if not self.step_seconds else 0.7 * self.step_seconds + 0.3 * seconds
        self._last_step_end = now
        evaluation = self.eval_steps * self.step_seconds if self.eval_seconds is None else self.eval_seconds
        spent, step, reserve = dist_utils.all_max(self.info, [self.spent_now(), self.step_seconds,
                                                              evaluation + self.save_seconds], self.device)
        self._agreed, self._reserve = spent, reserve
        return spent + step + reserve > self.budget  # agreed: the ranks end at one step

    def timed(self, what: str, seconds: float) -> None:
        """An evaluation's or a save's measured time (``what``: eval or save), for the reserve at the end. The step
        after them is not timed as a step."""
        setattr(self, f"{what}_seconds", seconds)
        self._last_step_end = self.clock()


def run_length(cfg: TrainConfig, info: dist_utils.DistInfo, device: torch.device, started: float, spent_before: float,
               state_bytes: int, clock: Callable[[], float] = time.perf_counter) -> StepBudget | Deadline:
    """The run's length as its config gives it: a deadline reserves, for the last checkpoint, its ``state_bytes`` at
    SAVE_BYTES_PER_S until a save is timed. ``clock``: the seconds it reads (``started`` is on it); a test's own."""
    if cfg.time_budget is None:
        return StepBudget(cfg.max_steps, clock)
    return Deadline(cfg.budget_seconds, spent_before, started, info, device,
                    eval_steps=cfg.eval_batches / (3 * cfg.grad_accum), save_seconds=state_bytes / SAVE_BYTES_PER_S,
                    clock=clock)
