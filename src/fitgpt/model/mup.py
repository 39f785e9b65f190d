"""muP's and CompleteP's multipliers inside the model (the settings: `ModelConfig.mup_base_width`, `mup_base_depth`;
the initialisation: `transformer.init_std`; the per-width learning rates: `fitgpt.optim.mup_groups`)."""

from __future__ import annotations

import torch


def branch(y: torch.Tensor, mult: float) -> torch.Tensor:
    """A residual branch's output as it joins the stream (B, T, C): CompleteP's multiplier, where it is not 1 (the
    standard parametrisation's graph is left as it was: no op, no tensor)."""
    return y if mult == 1.0 else y * mult
