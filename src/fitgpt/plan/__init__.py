"""Planning: decide, from a workload's profile (`fitgpt.estimate`), what to train with.

    solver.py       the fastest checkpointing plan under a memory budget, and any plan's predicted peak and time
    auto.py         --activation-checkpointing auto: a training config to a concrete plan
    largest.py      `fitgpt fit`, first half: the largest batch, context and depth that fit
    fastest.py      `fitgpt fit`, second half, and --auto-config: the fastest whole configuration that fits
    extrapolate.py  a profile at an unprofiled size, fitted exactly through profiled ones
    module.py       plan_module: any nn.Module planned from a function that builds it
"""

from fitgpt.plan.module import ModulePlan, plan_module
from fitgpt.plan.solver import Plan, PlanError, Prediction, min_peak, predict, solve, solve_exhaustive

__all__ = ["ModulePlan", "Plan", "PlanError", "Prediction", "min_peak", "plan_module", "predict", "solve", "solve_exhaustive"]
