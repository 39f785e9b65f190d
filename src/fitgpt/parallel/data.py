"""DDP around a model, as training runs it and as planning profiles it (on a fake process group): the gradients
views into its all-reduce buckets; and the context each micro-batch runs in, DDP's or FSDP's."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


def ddp_wrap(model: nn.Module, device_ids: list[int] | None = None, fake: bool = False) -> nn.Module:
    """DDP around ``model``, its gradients views into the all-reduce buckets (no second copy of every gradient).

    ``fake``: on the planner's fake tensors and fake ranks, where nothing can be read: no first broadcast of the
    weights; each bucket's all-reduce done in place, as NCCL's and gloo's are (the fake process group's yields no
    tensor); and no rebuilding of the buckets in the second step (it reads rank 0's bucket order as values). A real
    rebuild frees the old buckets first; with accumulation, whose gradients still hold them, each as its successor is
    made: about one bucket (25 MiB) more, once. The buckets, the gradients' views and every other allocation of the
    step are DDP's own."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, init_sync=not fake)
    if fake:
        ddp.register_comm_hook(None, _reduced_in_place)
        ddp.reducer = _KeepsBuckets(ddp.reducer)
    return ddp


class _KeepsBuckets:
    """DDP's reducer as the module calls it, with the buckets never rebuilt (the only call that differs)."""

    def __init__(self, reducer) -> None:
        self._reducer = reducer

    def __getattr__(self, name: str):
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


def _reduced_in_place(state, bucket):  # unannotated: DDP checks a hook's annotations against its classes, not strings
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def sync_context(step_model: nn.Module, last_micro_batch: bool) -> contextlib.AbstractContextManager:
    """The context a micro-batch runs in. DDP skips its all-reduce on all but the last: the gradients add up in its
    buckets, which are held anyway. FSDP reduce-scatters every micro-batch, as torchtitan does: between micro-batches
    a rank holds its shard of the gradients, never the whole model's unsharded."""
    if last_micro_batch or not hasattr(step_model, "no_sync"):
        return contextlib.nullcontext()
    return step_model.no_sync()
