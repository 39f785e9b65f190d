"""Any causal language model as fitgpt's step calls one: ``model(idx, targets) -> (logits, loss)``.

``train_step`` and the profiler call ``model(x, y)[1]`` with ``y`` the next token of each position (already
shifted). A Hugging Face model takes ``input_ids`` and ``labels`` and shifts the labels itself; a hand-written
module may give a loss alone, a tuple, or an output object. ``CausalLM`` holds either and answers as ours does,
calling the model as its own training does (a Hugging Face model runs its own loss: logits cast to fp32, then
cross-entropy), so what is planned is what that model allocates.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from fitgpt.errors import UserError


class CausalLM(nn.Module):
    """``model`` called with (idx, targets) and answering (logits, loss); ``hf``: a ``transformers`` causal LM."""

    def __init__(self, model: nn.Module, hf: bool = False) -> None:
        super().__init__()
        self.model = model
        self.hf = hf

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if self.hf:
            # shift_labels: the targets are shifted already (fitgpt's batches), so the loss covers all T positions
            # as ours does; labels only switches the loss on.
            with _unpacked() if isinstance(idx, FakeTensor) else contextlib.nullcontext():
                out = self.model(input_ids=idx, labels=targets, shift_labels=targets, use_cache=False)
            return out.logits, out.loss
        return logits_and_loss(self.model(idx, targets), type(self.model).__name__)


def logits_and_loss(out: object, name: str) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits, loss) of what a module's forward gave: a loss, a tuple or list holding one (with or without the logits,
    in either order), or an object with ``.loss``. The loss is the one-value tensor; anything without one is refused,
    saying what came back."""
    if isinstance(out, torch.Tensor):
        parts = [out]
    elif isinstance(out, (tuple, list)):
        parts = list(out)
    else:
        parts = [getattr(out, "logits", None), getattr(out, "loss", None)]
    tensors = [t for t in parts if isinstance(t, torch.Tensor)]
    losses = [t for t in tensors if t.numel() == 1]
    if len(losses) != 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors) or type(out).__name__
        raise UserError(f"{name}.forward(idx, targets) gave {shapes}: no one loss to train on; return the loss, "
                        "(logits, loss) or an object with .loss")
    logits = next((t for t in tensors if t.dim() >= 2), None)
    return logits, losses[0]


def _unpacked():
    """Tell ``transformers`` the positions are one sequence per row, as it finds by reading them on real tensors (a
    fitgpt batch packs no sequences). Fake tensors have no values to read: it would take the batch as packed and build
    the (B, 1, T, T) mask a real step never builds, with SDPA then called with that mask instead of ``is_causal``."""
    from transformers import masking_utils

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)
