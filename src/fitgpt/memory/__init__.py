"""Measuring memory and compute: live bytes, saved bytes, FLOPs, and a training step cut into segments."""

from fitgpt.memory.flops import OpFlops, count_flops
from fitgpt.memory.measure import StepMemory, measure_step_flops, measure_step_memory
from fitgpt.memory.timeline import (
    PeakProbe,
    StepPeak,
    StepTimeline,
    measure_train_step,
    profile_step,
)
from fitgpt.memory.tracker import LiveMemory, SavedTensors

__all__ = [
    "LiveMemory", "OpFlops", "PeakProbe", "SavedTensors", "StepMemory", "StepPeak", "StepTimeline", "count_flops",
    "measure_step_flops", "measure_step_memory", "measure_train_step", "profile_step",
]
