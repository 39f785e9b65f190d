"""Plan memory: profile a config per option, predict any plan's peak, solve for the cheapest that fits."""

from fitgpt.plan.auto import plan_for
from fitgpt.plan.profile import StepProfile, profile_model
from fitgpt.plan.solver import (
    Plan,
    PlanError,
    Prediction,
    min_peak,
    predict,
    solve,
    solve_exhaustive,
)

__all__ = ["Plan", "PlanError", "Prediction", "StepProfile", "min_peak", "plan_for", "predict", "profile_model", "solve",
           "solve_exhaustive"]
