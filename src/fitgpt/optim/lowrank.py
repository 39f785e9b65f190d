"""GaLore and APOLLO, as their authors package them (``galore-torch``, ``apollo-torch``): each hidden matrix's
gradient projected to a low rank, the optimizer's state kept in that space.

- GaLore (Zhao et al. 2024): the projection is the top ``rank`` singular vectors of the gradient, refreshed by an SVD
  every ``update_proj_gap`` steps; AdamW's two moments (or Adafactor's factors, or 8-bit moments) are kept for the
  projected gradient (rank x n or m x rank) and the update projected back, scaled by ``scale``.
- APOLLO (Zhu et al. 2024): the projection is random (seeded per parameter, re-drawn every gap), the low-rank AdamW
  moments only serve to scale the full gradient, per channel (APOLLO) or per tensor (APOLLO-Mini, rank 1).

The libraries' optimizers are used as they are; what is added here is what a training run needs of them:
- checkpoints: each projector (a Python object in the optimizer's state) is saved as tensors (its matrix and, for a
  random projector, its seed), and rebuilt when loaded, so that a resume is bitwise;
- memory: GaLore's SVD projector keeps a view of U or Vh, which holds the whole factor (min(m, n) x n, as large as a
  square matrix): it is kept as a copy of the rank rows it uses;
- planning: under the planner's fake tensors every step refreshes its projection (the larger of the two steps: the
  SVD's or the random draw's temporaries on top of the ordinary step), APOLLO's random matrix is drawn without a
  generator and its seed not advanced, and its norm limiter takes the branch that holds one more scalar.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import sys
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from fitgpt.errors import UserError

# name -> (module, class, the method's own defaults as its authors' recipes give them)
METHODS: dict[str, tuple[str, str, dict]] = {
    "galore-adamw": ("galore_torch", "GaLoreAdamW", {"rank": 128, "update_proj_gap": 200, "scale": 0.25}),
    "galore-adamw8bit": ("galore_torch", "GaLoreAdamW8bit", {"rank": 128, "update_proj_gap": 200, "scale": 0.25}),
    "galore-adafactor": ("galore_torch", "GaLoreAdafactor", {"rank": 128, "update_proj_gap": 200, "scale": 0.25}),
    "apollo": ("apollo_torch", "APOLLOAdamW", {"rank": 256, "update_proj_gap": 200, "scale": 1.0, "proj": "random",
                                              "scale_type": "channel"}),
    "apollo-mini": ("apollo_torch", "APOLLOAdamW", {"rank": 1, "update_proj_gap": 200, "scale": 128.0, "proj": "random",
                                                   "scale_type": "tensor"}),
}
PROJECTION, SEED = "projection", "projection_seed"  # a projector's tensors in a saved state


def settings(name: str, rank: int, update_proj_gap: int, scale: float, limit: int | None = None) -> dict:
    """The projected group's settings: the method's own, with those given (0: the method's) in their place. The
    method's own rank is capped at ``limit`` (`rank_limit`): a rank beyond every matrix's would project none further."""
    given = {"rank": rank, "update_proj_gap": update_proj_gap, "scale": scale}
    own = METHODS[name][2]
    if limit is not None and not rank:
        own = {**own, "rank": min(own["rank"], limit)}
    return {**own, **{k: v for k, v in given.items() if v}, "proj_type": "std"}


def rank_limit(matrices) -> int:
    """The highest rank a projection of ``matrices`` (the hidden matrices, as shapes or tensors) can have: the longest
    of their shorter sides. GaLore keeps at most that many singular vectors of a matrix; APOLLO projects past it."""
    return max((min(m.shape if isinstance(m, torch.Tensor) else m) for m in matrices), default=0)


@contextlib.contextmanager
def no_code_from_the_hub() -> Iterator[None]:
    """Imports under which nothing reaches for a model hub: bitsandbytes (which both libraries import) fetches a CPU
    kernel from one at import where the CPU has AVX-512 bf16, a download of code that fitgpt never runs (its CPU
    ops are never called here), that fails offline and warns. The ``kernels`` package is hidden for the import, so
    that bitsandbytes takes its own fallback at once; its warning about it is dropped."""
    hidden = "kernels" not in sys.modules
    if hidden:
        sys.modules["kernels"] = None  # an import of it raises ImportError
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)
        if hidden:
            del sys.modules["kernels"]


def _library(name: str):
    module, cls, _ = METHODS[name]
    package = module.replace("_", "-")
    try:
        with no_code_from_the_hub():
            return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise UserError(f"--optim.name {name} needs {package} (and bitsandbytes, which it imports): pip install "
                        f"'fitgpt[lowrank]' ({e})") from None


def _fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def _compact(m):
    """A projection that views a larger factor (GaLore's ``Vh[:rank]`` or ``U[:, :rank]``), as a tensor of its own."""
    if isinstance(m, torch.Tensor) and m.untyped_storage().nbytes() > m.numel() * m.element_size():
        return m.clone()
    return m


def _projector_classes():
    """GaLore's SVD projector and APOLLO's random one, each with the additions above."""
    with no_code_from_the_hub():
        from apollo_torch.random_projector import GradientProjector
        from galore_torch.galore_projector import GaLoreProjector

    class SVD(GaLoreProjector):
        def project(self, grad, iter):
            low = super().project(grad, 0 if _fake(grad) else iter)
            self.ortho_matrix = _compact(self.ortho_matrix)
            return low

    class Random(GradientProjector):
        def project(self, grad, iter):
            return super().project(grad, 0 if _fake(grad) else iter)

        def update_ortho_matrix(self, grad, proj_type):
            if not _fake(grad):
                return super().update_ortho_matrix(grad, proj_type)
            shape = (grad.shape[0], self.rank) if proj_type == "left" else (self.rank, grad.shape[1])
            self.ortho_matrix = torch.randn(shape, device=grad.device, dtype=torch.float32) / math.sqrt(self.rank)

    return SVD, Random


@contextlib.contextmanager
def _fake_branches() -> Iterator[None]:
    """APOLLO's norm limiter (``max(ratio, 1.01)``) asks a tensor for a bool: under fake tensors, the ratio wins."""
    to_bool = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda t: False if _fake(t) else to_bool(t)
    try:
        yield
    finally:
        torch.Tensor.__bool__ = to_bool


def projected_groups(groups: list[dict], projected: set[int], setting: dict) -> list[dict]:
    """``groups`` cut into runs of parameters projected or not (``projected``: their ids), in their order, so that the
    state dict's indices still follow the parameters'; the projected runs carry ``setting``."""
    runs = []
    for g in groups:
        for p in g["params"]:
            inside = id(p) in projected
            if not runs or runs[-1][0] is not g or runs[-1][1] != inside:
                runs.append((g, inside, []))
            runs[-1][2].append(p)
    return [{**g, **(setting if inside else {}), "params": ps} for g, inside, ps in runs]


def build(name: str, groups: list[dict], lr: float, betas: tuple[float, float], seeds: dict[int, int]) -> torch.optim.Optimizer:
    """``name``'s optimizer over ``groups`` (those with ``rank`` projected); ``seeds``: each parameter's projection
    seed, by id (of the parameter, or of the one an fp32 stand-in ``stands_for``), from its place in the whole model,
    as the library numbers them, so that stepping a parameter at a time draws what one optimizer over all would."""
    base = _library(name)
    svd, random = _projector_classes()
    kw = ({"relative_step": False, "scale_parameter": False, "warmup_init": False} if name == "galore-adafactor"
          else {"betas": betas, "no_deprecation_warning": True} if name == "galore-adamw" else {"betas": betas})

    class Projected(base):
        def __init__(self) -> None:
            super().__init__(groups, lr=lr, **kw)
            self._seeds()

        def _seeds(self) -> None:
            """The library's numbering of the projected parameters, replaced by the whole model's."""
            for g in self.param_groups:
                for p in g["params"]:
                    if "rank" in g and name.startswith("apollo"):
                        self.state[p]["seed"] = seeds[id(getattr(p, "stands_for", p))]

        def _initialize_projector(self, group, state):  # APOLLO's
            return random(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                          proj_type=group["proj_type"], seed=state["seed"])

        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:  # GaLore's projectors made here, as its step would, but of the class above
                for p in g["params"]:
                    state = self.state[p]
                    if "rank" in g and p.grad is not None and not name.startswith("apollo") and "projector" not in state:
                        state["projector"] = svd(g["rank"], update_proj_gap=g["update_proj_gap"], scale=g["scale"],
                                                 proj_type=g["proj_type"])
            fake = any(_fake(p) for g in self.param_groups for p in g["params"])
            with _fake_branches() if fake else contextlib.nullcontext():
                return super().step(closure)

        def state_dict(self) -> dict:
            sd = super().state_dict()
            return {**sd, "state": {i: _pack(s) for i, s in sd["state"].items()}}

        def load_state_dict(self, state_dict: dict) -> None:
            saved = {k: dict(s) for k, s in state_dict["state"].items()}
            projections = {k: (s.pop(PROJECTION, None), s.pop(SEED, None)) for k, s in saved.items()}
            super().load_state_dict({**state_dict, "state": saved})
            self._seeds()  # a parameter that never stepped has none saved (the same numbers)
            params = [(p, g) for g in self.param_groups for p in g["params"]]  # in the state dict's order
            for k, (matrix, seed) in projections.items():
                p, group = params[int(k)]
                if matrix is None or "rank" not in group:
                    continue
                state = self.state[p]
                proj = (self._initialize_projector(group, state) if name.startswith("apollo") else
                        svd(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                            proj_type=group["proj_type"]))
                proj.ortho_matrix = matrix.to(p.device)
                if seed is not None:
                    proj.seed = int(seed)
                state["projector"] = proj

    return Projected()


def _pack(state: dict) -> dict:
    """A parameter's saved state: its projector as tensors."""
    proj = state.get("projector")
    packed = {k: v for k, v in state.items() if k != "projector"}
    if proj is not None and proj.ortho_matrix is not None:
        packed[PROJECTION] = proj.ortho_matrix
        if hasattr(proj, "seed"):
            packed[SEED] = torch.tensor(proj.seed, dtype=torch.int64)
    return packed
