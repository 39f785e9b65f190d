"""More than one process: torch.distributed set up from torchrun's environment, DDP or FSDP2 around the model.

Launched by ``torchrun --nproc-per-node N -m fitgpt train ...`` the trainer finds RANK, WORLD_SIZE
and LOCAL_RANK in the environment; without them everything here is a no-op for one process.
Checkpoints under torchrun are distributed (`fitgpt.train.dist_checkpoint`): every rank writes its own shards,
and any world size, one process included, reads them back.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from fitgpt.errors import UserError
from fitgpt.parallel.data import ddp_wrap
from fitgpt.parallel.fsdp import fsdp_shard
from fitgpt.parallel.placement import shard_like

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def data_ranks(cfg, info: DistInfo) -> int:
    """The data-parallel degree under ``cfg`` (a TrainConfig): the processes over the ranks that split one model."""
    return info.world // cfg.model_splits()


def data_rank(cfg, info: DistInfo) -> int:
    """This process's data-parallel rank under ``cfg`` (a TrainConfig): the ranks that split one model (a
    tensor-parallel group, a pipeline's stages) draw the same batches. Tensor-parallel groups are consecutive ranks;
    a stage's data-parallel ranks are."""
    if cfg.pipeline_parallel > 1:  # the mesh (pp, dp, tp): a stage's ranks are the last two
        return info.rank % (info.world // cfg.pipeline_parallel) // cfg.tensor_parallel
    return info.rank // cfg.tensor_parallel


def init_distributed(device_name: str, timeout_s: float) -> DistInfo:
    """Join the process group torchrun describes (gloo on CPU, NCCL on CUDA); one process: nothing to do."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or "RANK" not in os.environ:
        return DistInfo()
    info = DistInfo(rank=int(os.environ["RANK"]), world=world, local_rank=int(os.environ.get("LOCAL_RANK", "0")))
    use_cuda = torch.cuda.is_available() and device_name in ("auto", "cuda") or device_name.startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        # The timeout bounds every collective: a rank that died never leaves the others waiting forever.
        timeout = timedelta(seconds=timeout_s)
        store, _, _ = next(dist.rendezvous("env://", info.rank, world, timeout=timeout))
        # A group restarted by torchrun (--max-restarts) meets in the same store: under a prefix of its attempt, so
        # that gloo never reads the addresses of the group it replaces (its full mesh timed out connecting to them).
        attempt = dist.PrefixStore(f"fitgpt/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=attempt, rank=info.rank, world_size=world,
                                timeout=timeout)
    # Meshes of groups destroyed before this run (whatever ran earlier in the process, without `shutdown`) may still
    # sit in DTensor's caches, which would hand them to this run's equal meshes. Only where a mesh exists: emptying
    # the caches in a fresh torchrun worker kept its heartbeat from ever naming a stopped rank (not understood yet).
    if _meshes_alive():
        forget_sharding()
    return info


def _meshes_alive() -> bool:
    """Whether this process holds any DeviceMesh (one made before this run: a run makes its own after this)."""
    from torch.distributed.device_mesh import DeviceMesh

    return any(isinstance(obj, DeviceMesh) for obj in gc.get_objects())


# ---- a rank lost ----------------------------------------------------------------------------------

HEARTBEAT_S = 1.0
# What gloo and NCCL say when the rank at the other end of a collective is gone, or silent past --dist-timeout.
_LOST_PEER = ("connection reset by peer", "connection closed by peer", "connection refused", "broken pipe", "timed out",
              "timeout", "communicator was aborted", "socket closed")


class Heartbeat:
    """Each rank counts up in the rendezvous store every second, on a connection of its own. A rank whose collective
    failed marks itself as a survivor and reads the counts twice: the ranks whose counts stood still, and that are not
    survivors, are the ones lost (no two machines' clocks are compared)."""

    def __init__(self, info: DistInfo, timeout_s: float = 10.0, on_stalled: Callable[[int], None] | None = None,
                 stalled_s: float = 20.0):
        self.info, self.stalled_s = info, stalled_s  # a count standing still this long: the rank stopped, or hung
        self.prefix = f"fitgpt/liveness/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self.store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                   timeout=timedelta(seconds=timeout_s))
        # Each rank watches the next (a ring): every rank is watched by one other, and the store is read once a
        # second a rank, at any world size.
        self.on_stalled, self.watched = on_stalled, (info.rank + 1) % info.world if info.world > 1 else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fitgpt-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def start(cls, info: DistInfo, on_stalled: Callable[[int], None] | None = None,
              stalled_s: float = 20.0) -> Heartbeat | None:
        """Heartbeats for a torchrun launch (None for one process, or if the store cannot be reached: a lost rank is
        then named only by the collective's own error). ``on_stalled(rank)``: called (from the heartbeat's thread)
        once the watched rank has not counted for ``stalled_s`` (--dist-stall-timeout) and has not finished."""
        if not info.enabled or "MASTER_ADDR" not in os.environ:
            return None
        try:
            return cls(info, on_stalled=on_stalled, stalled_s=stalled_s)
        except Exception as e:  # the training does not depend on it
            log.warning("no heartbeats (the rendezvous store at %s:%s: %s)", os.environ.get("MASTER_ADDR"),
                        os.environ.get("MASTER_PORT"), e)
            return None

    def _beat(self) -> None:
        count, seen, since = 0, None, time.monotonic()
        while not self._stop.wait(HEARTBEAT_S):
            count += 1
            try:
                self.store.set(f"{self.prefix}beat/{self.info.rank}", str(count))
                if self.on_stalled is not None and self.watched is not None:
                    seen, since = self._watch(seen, since)
            except Exception:  # the store's machine is gone: lost_ranks will say so
                return

    def _watch(self, seen: bytes | None, since: float) -> tuple[bytes | None, float]:
        """The watched rank's count, and since when it has stood still; a rank stopped (SIGSTOP) or hung where no
        collective will ever fail is reported through ``on_stalled`` (a finished rank is not)."""
        key = f"{self.prefix}beat/{self.watched}"
        now = self.store.get(key) if self.store.check([key]) else None
        if now is None or now != seen:
            return now, time.monotonic()
        if time.monotonic() - since > self.stalled_s and not self.store.check([f"{self.prefix}done/{self.watched}"]):
            self.on_stalled(self.watched)
        return seen, since

    def stop(self) -> None:
        """Say this rank finished, and end the heartbeat's thread: a thread still inside the store's C++ client as the
        interpreter shuts down can take the process down with it."""
        self._stop.set()
        self._thread.join(timeout=2 * HEARTBEAT_S + 5.0)  # it wakes within a beat; a store call has its own timeout
        try:  # a rank that finished is not a stalled one to the rank watching it
            self.store.set(f"{self.prefix}done/{self.info.rank}", "1")
        except Exception:
            pass

    def lost_ranks(self) -> list[int] | None:
        """The ranks lost, read over three heartbeats; None if the store itself is unreachable (its machine is lost)."""
        try:
            self.store.set(f"{self.prefix}survivor/{self.info.rank}", "1")
            first = self._counts()
            time.sleep(3 * HEARTBEAT_S)
            second = self._counts()
            survivors = {r for r in range(self.info.world) if self.store.check([f"{self.prefix}survivor/{r}"])}
        except Exception:
            return None
        return [r for r in range(self.info.world) if r != self.info.rank and first[r] == second[r] and r not in survivors]

    def _counts(self) -> list[bytes | None]:
        keys = [f"{self.prefix}beat/{r}" for r in range(self.info.world)]
        return [self.store.get(k) if self.store.check([k]) else None for k in keys]


def is_lost_peer(e: BaseException) -> bool:
    """Whether ``e`` is a collective failing because another rank is gone (or silent past --dist-timeout)."""
    text = str(e).lower()
    return isinstance(e, dist.DistError) or isinstance(e, RuntimeError) and any(s in text for s in _LOST_PEER)


def describe_lost(info: DistInfo, heartbeat: Heartbeat | None, e: BaseException) -> str:
    """One line: which rank was lost, that every rank stops, and how to go on."""
    lost = heartbeat.lost_ranks() if heartbeat else []
    if lost is None:
        who = (f"lost the rendezvous store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} (its machine, "
               "the first node, stopped or is unreachable)")
    elif lost:
        who = f"lost rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} of {info.world} (its process or machine stopped)"
    else:
        who = f"a collective failed between the {info.world} ranks ({(str(e).strip().splitlines() or [''])[0][:200]})"
    return (f"{who}, so rank {info.rank} stops too, leaving every checkpoint whole. Continue with the same command and "
            "--resume auto (torchrun --max-restarts N does that by itself)")


def describe_stalled(info: DistInfo, rank: int, stalled_s: float) -> str:
    """One line: which rank stopped answering, that this one stops, and how to go on."""
    return (f"rank {rank} of {info.world} stopped answering (no heartbeat for {stalled_s:.0f} s, --dist-stall-timeout: "
            f"its process is stopped or hung), so rank {info.rank} stops too, leaving every checkpoint whole. Continue "
            "with the same command and --resume auto once that rank's machine is sound (torchrun --max-restarts N does "
            "that by itself)")


def meet(info: DistInfo) -> None:
    """Every rank waits here for the others: before rank 0 writes what every rank's success decides (a resume's run
    files), and at a run's good end (a rank tearing its connections down while another still works, rank 0 drawing
    the loss curve, could abort that one)."""
    if info.enabled and dist.is_initialized():
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process groups, and end their threads now, while the interpreter is whole.

    ``destroy_process_group`` forgets the groups, but a DeviceMesh keeps its own in ``_pg_registry``, and DTensor's
    sharding caches keep every mesh a sharded parameter ever had (FSDP's and tensor parallelism's). Such a gloo group
    lived on to the interpreter's shutdown, its worker threads with it, and a worker still letting go of a finished
    collective's tensors there needs the GIL: the interpreter ends that thread, its unwinding meets a noexcept C++
    frame, and the process aborts ("terminate called without an active exception") after the run is done, more
    often the busier the machine. So the meshes let go of their groups here, and the groups are collected at once:
    each one's destructor joins its workers."""
    if not (info.enabled and dist.is_initialized()):
        return
    dist.destroy_process_group()
    release_meshes()
    if left := gloo_threads():  # something else of PyTorch's still holds a group: say so before any abort at exit
        log.warning("%d of gloo's threads still run after the process groups were destroyed (%s): this process may "
                    "abort at exit, its run already saved", len(left), ", ".join(sorted(set(left))))


def release_meshes() -> None:
    """Every DeviceMesh alive (in DTensor's caches too) lets go of its process groups, and those are destroyed now;
    DTensor's sharding caches forget them (`forget_sharding`)."""
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # meshes only reachable through cycles go with them
    for obj in gc.get_objects():
        if isinstance(obj, DeviceMesh) and getattr(obj, "_pg_registry", None):
            obj._pg_registry.clear()
    forget_sharding()
    gc.collect()  # the groups a cycle held


def forget_sharding() -> None:
    """Empty DTensor's sharding caches (Python's and the C++ fast path's). They key each op by its meshes' shapes, not
    their groups, and hand back the meshes they first saw: a mesh made after the groups were destroyed, equal in
    shape, got an old one whose groups were gone, and its next collective failed ("Could not resolve the process
    group registered under the name 7": a second run in one process, a test after another on the same ranks)."""
    try:
        from torch.distributed.tensor import _redistribute
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # another PyTorch: nothing of this to forget, or no way to
        return
    _clear_sharding_prop_cache()
    # The redistribution planners are kept by a weak reference to their mesh, which an equal mesh also matches.
    for clear in (getattr(_redistribute, "clear_redistribute_planner_cache", None),
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)):
        if clear is not None:
            clear()


def gloo_threads() -> list[str]:
    """The names of this process's threads that belong to gloo (its process groups' workers and transport loops)."""
    names = []
    for task in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            if (name := task.read_text().strip()).startswith(("pt_gloo", "gloo")):
                names.append(name)
    return names


def local_device(info: DistInfo, device: torch.device) -> torch.device:
    """Each rank its own GPU under CUDA; CPU ranks share the CPU."""
    if info.enabled and device.type == "cuda":
        return torch.device("cuda", info.local_rank)
    return device


def all_mean_tensor(info: DistInfo, value: torch.Tensor) -> torch.Tensor:
    """The mean of a 0-d tensor over ranks, as a collective on the device (no host sync)."""
    if not info.enabled:
        return value
    t = value.detach().to(torch.float64).clone()
    dist.all_reduce(t)
    return t / info.world


def any_rank(info: DistInfo, flag: bool, device: torch.device) -> bool:
    """True on every rank if it is true on any (so that all ranks take the same branch)."""
    if not info.enabled:
        return flag
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_max(info: DistInfo, values: list[float], device: torch.device) -> list[float]:
    """Each of ``values``, the largest any rank holds (so that all ranks decide alike on a measured time)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def from_main(info: DistInfo, fn):
    """``fn()`` computed on rank 0 and handed to every rank (a choice all ranks must share, made once). A user error
    it raises is raised on every rank, so that all of them stop with the same one line (rather than the others
    losing their connection to rank 0 at its exit); a bug stops them too, with its traceback on rank 0."""
    if not info.enabled:
        return fn()
    box: list = [None]
    if info.is_main:
        try:
            box = [("ok", fn())]
        except Exception as e:
            box = [("error" if isinstance(e, UserError) else "bug", str(e))]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0][0] == "error":
        raise UserError(box[0][1])
    if box[0][0] == "bug":
        raise RuntimeError(f"rank 0 failed: {box[0][1]} (its traceback is in rank 0's output)")
    return box[0][1]


def gather_objects(info: DistInfo, obj) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if not info.enabled:
        return [obj]
    out: list = [None] * info.world
    dist.all_gather_object(out, obj)
    return out


def wrap(model: nn.Module, info: DistInfo, parallel: str, device: torch.device, param_dtype: torch.dtype | None,
         offload: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """DDP around the (checkpointed, maybe compiled) model, or FSDP2 per block and then the root (``offload``: FSDP2's
    CPUOffloadPolicy, parameters, gradients and optimizer state in pinned host memory; ``reshard_after_forward``: as
    `fsdp_shard` takes it)."""
    if not info.enabled:
        return model
    if parallel == "ddp":
        return ddp_wrap(model, [device.index] if device.type == "cuda" else None)
    return fsdp_shard(model, param_dtype, offload, pin_memory=device.type == "cuda", reshard_after_forward=reshard_after_forward)


@torch.no_grad()
def broadcast_weights(info: DistInfo, model: nn.Module, weights: dict[str, torch.Tensor] | None, device: torch.device,
                      skip: set[str], whole: dict[str, torch.Tensor] | None = None) -> None:
    """Rank 0's whole ``weights`` into every rank's ``model``, a tensor at a time (a collective): under FSDP each rank
    keeps its shard of each, so no rank ever holds the whole model but rank 0. ``skip``: tied names, filled through
    the name each shares. ``whole``: the whole model's tensors by name (their shapes and dtypes), where ``model`` is a
    pipeline rank's stages, which hold some of them: every name is sent, each kept where it is held."""
    from fitgpt.parallel.placement import assign_whole

    own = model.state_dict(keep_vars=True)
    for name in sorted(set(whole or own) - skip):  # one order on every rank
        p = (whole or own)[name]
        t = weights[name].to(device) if info.is_main else torch.empty(p.shape, dtype=p.dtype, device=device)
        dist.broadcast(t, src=0)
        if name in own:
            assign_whole(own[name], t)


# ---- full state for checkpoints ---------------------------------------------------------------------


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Load a single-process optimizer state into an optimizer over (maybe sharded) parameters."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {
            k: shard_like(p, v.to(p.device))
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for k, v in s.items()
        }
    optimizer.load_state_dict({**sd, "state": state})
