"""Muon: PyTorch's (``torch.optim.Muon``) on the hidden matrices, AdamW on the rest (the embeddings, the output head,
norms and biases), as Muon's authors run it. One fp32 momentum buffer a matrix (4 bytes a parameter, against AdamW's
8), each update orthogonalised by Newton-Schulz iterations; its lr adjusted to match AdamW's update RMS
(``adjust_lr_fn="match_rms_adamw"``), so that the run's one learning rate and schedule serve both.

``MuonAdamW`` answers as one optimizer over all the parameters (``param_groups``, ``state``, and a state dict indexed
in the parameters' order), so its checkpoints are read and written as any optimizer's.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def hidden_matrices(model: nn.Module) -> set[nn.Parameter]:
    """The 2-D parameters Muon steps: not an embedding's table, and not the output head (tied to the embedding or not)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None) or (model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None)
    if head is not None:
        tables.add(id(head.weight))
    return {p for p in model.parameters() if p.dim() == 2 and id(p) not in tables}


class MuonAdamW:
    """``muon`` over some of ``order``'s parameters and ``adamw`` over the others, as one optimizer."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer, order: list[torch.Tensor]) -> None:
        self.parts, self.defaults = (muon, adamw), adamw.defaults
        index = {id(p): i for i, p in enumerate(order)}
        # Where each part's parameters, in its state dict's order, stand in ``order``.
        self.positions = [[index[id(p)] for g in opt.param_groups for p in g["params"]] for opt in self.parts]

    @torch.no_grad()
    def step(self, closure=None) -> None:
        for opt in self.parts:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts for g in opt.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for opt in self.parts for p, s in opt.state.items()}

    def state_dict(self) -> dict:
        state, groups = {}, []
        for opt, where in zip(self.parts, self.positions):
            sd = opt.state_dict()
            state |= {where[i]: s for i, s in sd["state"].items()}
            groups += [{**g, "params": [where[i] for i in g["params"]]} for g in sd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Each part's state from its parameters' entries (keyed by int or, from a distributed checkpoint, by text);
        the groups' settings are the run's own (the schedule sets lr at every step)."""
        saved = {int(k): v for k, v in state_dict["state"].items()}
        for opt, where in zip(self.parts, self.positions):
            own = opt.state_dict()
            opt.load_state_dict({"state": {i: saved[w] for i, w in enumerate(where) if w in saved},
                                 "param_groups": own["param_groups"]})
