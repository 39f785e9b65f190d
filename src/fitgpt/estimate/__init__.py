"""Estimating a training step without running it at size: its memory, by segment and option, and its time.

    workload.py  `Workload`: one step to estimate, resolved once (the one path from a config to a profile)
    profile.py   the step profiled once per checkpointing option, on fake tensors or a real device
    timing.py    each op's seconds: calibrated on the device at hand, or a card's roofline
    hardware.py  the devices planned for: GPU datasheets, and what differs on CUDA (modelled)
    replay.py    a step replayed through CUDA's caching allocator (modelled): reserved memory
    deepen.py    a deep step's allocations and frees, from a shallow step's (for the replay)
"""
