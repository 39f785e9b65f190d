"""A measured step's peak, for the tests that hold it against a plan."""

from __future__ import annotations


def steady_peak(model, opt, batch, steps: int = 3) -> int:
    """The measured peak (the tracker) of a steady step: the least of steps 2 to ``steps`` + 1, the first making the
    optimizer state.

    The least, because a gloo worker thread drops its hold on a collective's buffer (DTensor's gather of a whole
    matrix) only when it next takes the GIL, at times after the next op has allocated: one step in about seven
    measured one buffer more (28,157 bytes on rank 1 of TP x 2, 975,388 planned). Each step after the first holds
    the same in the program's order; the least of three is that order's peak."""
    from fitgpt.memory.timeline import measure_train_step

    measure_train_step(model, opt, [batch], grad_clip=1.0)
    return min(measure_train_step(model, opt, [batch], grad_clip=1.0).peak for _ in range(steps))
