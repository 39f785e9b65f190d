"""Measuring memory and compute: live bytes, saved bytes, FLOPs."""

from fitgpt.memory.flops import count_flops
from fitgpt.memory.measure import StepMemory, measure_step_flops, measure_step_memory
from fitgpt.memory.tracker import LiveMemory, SavedTensors

__all__ = ["LiveMemory", "SavedTensors", "StepMemory", "count_flops", "measure_step_flops", "measure_step_memory"]
