"""What one profile is of (`Subject`), and the model as one rank of it holds it: built on the meta device with fake
parameters (`fake_model`), then split by tensor parallelism and sharded by FSDP as the trainer splits and shards it
(`sharded`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fitgpt.config import OptimConfig
from fitgpt.estimate.hardware import Target
from fitgpt.estimate.source import ModelSource
from fitgpt.memory.fake import FakeTensorMode, fake_mode, fake_module
from fitgpt.memory.flops import OpCost
from fitgpt.parallel.fsdp import fsdp_shard, precision_roles

BLOCK_OPTIONS = ("none", "pointwise", "selective", "block")


def fake_model(source: ModelSource, device: torch.device) -> tuple[torch.nn.Module, FakeTensorMode]:
    """The model built on the meta device (nothing allocated) with fake parameters on ``device``, and the
    mode every step on it runs under."""
    mode = fake_mode()
    with torch.device("meta"):
        return fake_module(source.build(), device, mode), mode


def sharded(model: torch.nn.Module, run: Subject) -> torch.nn.Module:
    """The model as one rank of ``run``'s FSDP, or of its tensor parallelism, holds it (unchanged without either)."""
    if run.tp_mesh is not None:
        from fitgpt.parallel.tensor import apply_tensor_parallel

        apply_tensor_parallel(model, run.tp_mesh)
    if run.mesh is not None:
        # as the trainer: pure half precision
        fsdp_shard(model, precision_roles(run.dtype, True)[1], mesh=run.mesh, reshard_after_forward=run.reshard)
    return model


@dataclass(frozen=True)
class Subject:
    """What one profile is of."""

    source: ModelSource
    batch_size: int
    context: int
    device: torch.device
    optim: OptimConfig
    grad_accum: int
    dtype: torch.dtype | None
    persistent_grads: bool
    target: Target
    optimizer_step: bool = True
    """False for the shallow profiles of a deep model, whose optimizer costs are taken at full depth."""
    cost: OpCost | None = None
    """Each op's seconds, for the segments' times."""
    mesh: object = None
    """The fake ranks' DeviceMesh when the step is one rank's under FSDP (None: one process, or DDP)."""
    options: tuple[str, ...] = BLOCK_OPTIONS
    """The block options profiled, one step each."""
    tp_mesh: object = None
    """The fake ranks' DeviceMesh when the step is one rank's under tensor parallelism (None: not split)."""
    reshard: bool = True
    """Under FSDP, each block's gathered weights freed after its forward (--fsdp-reshard-after-forward)."""

    @property
    def simulated(self) -> bool:
        """A CUDA target profiled on CPU: the attention backend's saved tensors are modelled."""
        return self.target.cuda and self.device.type != "cuda"

    @property
    def backend(self) -> str:
        return self.target.attention_backend(self.dtype, self.source.head_dim)
