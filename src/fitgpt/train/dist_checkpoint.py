"""Distributed checkpoints: under DDP and FSDP each rank writes its own shards of the weights and optimizer state with
PyTorch's DCP, in parallel, synchronously or in the background. The promises of `fitgpt.train.checkpoint` hold: a
temporary directory, renamed into place once every rank's files are written and meta.json (their checksums) is;
``latest`` falling back past a damaged one; ``--keep-last``.

A save: the ranks meet once on the training's process group (the temporary directory, each rank's data position and
RNG), rank 0 writes ``train_state.pt``, then DCP writes the shards, on a process group of the saves' own, so that a
background save's collectives never interleave with a step's. In the background each rank's state is first staged
(copied) to host memory, and the step goes on while a thread writes it. The next save waits for the previous one, and
so do the end of the run and a stop by a signal; a failed write is raised there, and never leaves a checkpoint.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from fitgpt.train import checkpoint as ckpt
from fitgpt.train import dcp_read
from fitgpt.train import distributed as dist_utils

log = logging.getLogger(__name__)


class DistributedSaver:
    """Writes a run's checkpoints with DCP, on every rank; ``background``: asynchronously, one save in flight at a time."""

    def __init__(self, info: dist_utils.DistInfo, run_dir: Path, keep_last: int, background: bool, timeout_s: float):
        self.info, self.run_dir, self.keep_last = info, Path(run_dir), keep_last
        # gloo, whatever trains: DCP's collectives exchange plans and results as host objects, and a thread runs them.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fitgpt-checkpoint") if background else None
        self.pending: Future | None = None

    def save(self, step: int, model: nn.Module, optimizer, train_state: dict | None, meta: dict | None) -> Path | None:
        """Checkpoint ``step`` (a collective: every rank calls it; ``train_state`` and ``meta`` are rank 0's). Returns
        the newest checkpoint known to be written: this one, or in the background the previous one (``wait`` returns
        this one). Raises CheckpointSaveError on every rank if any rank could not write, here or (in the background)
        at the next ``save`` or ``wait``."""
        previous = self.wait()  # one save in flight at a time: raises if the previous one failed
        outcome = dist_utils.from_main(self.info, lambda: self._begin(step, train_state))
        if outcome[0] == "error":
            raise ckpt.CheckpointSaveError(outcome[1], outcome[2])
        tmp, final = Path(outcome[1]), Path(outcome[2])
        # GPT-2's query/key/value matrix split by heads is written in row shards (dcp_read.contiguous)
        optim_state = optimizer.state_dict()
        if hasattr(model, "numbering"):  # a pipeline's stages: numbered as the whole model's
            optim_state = model.numbering.to_whole(optim_state)
        state = dcp_read.contiguous({"model": ckpt.model_state(model), "optimizer": optim_state})
        if self.pool is None:
            return self._write(state, tmp, final, step, meta)
        t0 = time.perf_counter()
        staged = _stage(state)  # the step may change every tensor once this returns
        log.info("checkpoint step %d staged to host memory in %.2fs; writing it in the background", step,
                 time.perf_counter() - t0)
        self.pending = self.pool.submit(self._write, staged, tmp, final, step, meta)
        return previous

    def wait(self) -> Path | None:
        """The save in flight, finished (every rank calls it): its checkpoint, or None if there was none."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        return pending.result()

    def close(self) -> Path | None:
        """Finish the save in flight (a collective) and stop the writer thread; returns that save's checkpoint."""
        try:
            return self.wait()
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def close_after_failure(self) -> None:
        """``close`` as a run stops on an error: the save in flight is finished if the ranks still can, and its
        own failure is logged, never raised in place of the one that stopped the run."""
        try:
            self.close()
        except Exception as e:
            log.warning("the checkpoint being written when the run stopped was not finished: %s", e)

    def _begin(self, step: int, train_state: dict) -> tuple:
        """Rank 0: the temporary directory, and the training state in it (a failure is handed to every rank)."""
        try:
            tmp, final = ckpt.temp_dir(self.run_dir, step)
            tmp.mkdir()
            torch.save(train_state, tmp / ckpt.TRAIN_STATE_FILE)
        except (OSError, RuntimeError) as e:
            error = ckpt.save_failed(e, self.run_dir, step) if not isinstance(e, ckpt.CheckpointSaveError) else e
            if "tmp" in locals():
                shutil.rmtree(tmp, ignore_errors=True)
            return ("error", error.errno, error.strerror or str(error))
        return ("ok", str(tmp), str(final))

    def _write(self, state: dict, tmp: Path, final: Path, step: int, meta: dict | None) -> Path:
        """Every rank's shards, then (rank 0) meta.json, the rename and the pruning; on the saves' own group."""
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        files, error = {}, None
        try:
            dcp.save(state, checkpoint_id=str(tmp / ckpt.DCP_DIR), process_group=self.group)
            files = ckpt.file_records(tmp, _own_files(tmp, self.info.rank))
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when one rank's write fails
            error = ckpt.save_failed(dcp_read.dcp_cause(e), self.run_dir, step).strerror
        results: list = [None] * self.info.world
        dist.all_gather_object(results, (files, error), group=self.group)
        outcome = [None]
        if self.info.is_main:
            outcome = [self._finish(results, tmp, final, step, meta)]
        dist.broadcast_object_list(outcome, src=0, group=self.group)
        if outcome[0] is not None:
            raise ckpt.CheckpointSaveError(5, outcome[0])  # EIO: the reason is in the message
        log.info("saved %s (%d files, written in %.2fs)", final, sum(len(f) for f, _ in results), time.perf_counter() - t0)
        return final

    def _finish(self, results: list, tmp: Path, final: Path, step: int, meta: dict) -> str | None:
        """Rank 0, once every rank has written: meta.json last, then the rename. Returns the error, if any."""
        errors = [e for _, e in results if e]
        if not errors:
            try:
                files = {name: rec for own, _ in results for name, rec in own.items()}
                ckpt.write_meta(tmp, {**meta, "format": ckpt.DCP_FORMAT}, step, files)
                ckpt.publish(tmp, final)
            except OSError as e:
                errors = [ckpt.save_failed(e, self.run_dir, step).strerror]
        if errors:
            shutil.rmtree(tmp, ignore_errors=True)
            return errors[0]
        ckpt.prune(self.run_dir, step, self.keep_last)
        return None


def _own_files(tmp: Path, rank: int) -> list[str]:
    """The files this rank wrote, relative to the checkpoint: its DCP shards (``__R_*.distcp``), and on rank 0 DCP's
    metadata and the training state."""
    shards = sorted(f"{ckpt.DCP_DIR}/{p.name}" for p in (tmp / ckpt.DCP_DIR).glob(f"__{rank}_*.distcp"))
    return shards + ([f"{ckpt.DCP_DIR}/.metadata", ckpt.TRAIN_STATE_FILE] if rank == 0 else [])


def _stage(state: dict) -> dict:
    """A copy of every tensor in host memory (DTensors keep their placement), taken before the step changes them."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                          use_non_blocking_copy=False))
    try:
        return stager.stage(state)
    finally:
        stager.close()


def load_optimizer(optimizer, saved, info: dist_utils.DistInfo, numbering=None) -> None:
    """The checkpoint's optimizer state into ``optimizer``: a whole state dict (one process's checkpoint), or a
    distributed checkpoint's, of which each rank reads the pieces of its own shards (any world size wrote it). The
    groups' settings are this run's, as it was built and logs them (a changed --optim.weight-decay or beta steps as
    asked), not the saved ones that loading a state dict would restore. ``numbering``: a pipeline rank's
    (`fitgpt.parallel.stages.Numbering`), whose parameters the checkpoint numbers as the whole model's."""
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.state_dict()["param_groups"]]
    if isinstance(saved, dict):
        if numbering is not None:
            saved = numbering.to_own(saved, optimizer.state_dict())
        dist_utils.load_full_optimizer_state(optimizer, _with_settings(saved, settings))
        return
    where = str(saved.path / ckpt.DCP_DIR)
    try:
        if info.enabled:
            init_optimizer_state(optimizer)
            own = optimizer.state_dict()
            template = numbering.to_whole(own) if numbering is not None else own  # read into in place
            dcp_read.load({"optimizer": template}, where)
            template = numbering.to_own(template, own) if numbering is not None else template
        else:  # one process holds the whole state: read it as saved, whatever wraps the optimizer
            template = _read_whole(where, "optimizer")
        optimizer.load_state_dict(_with_settings(template, settings))
    except (Exception, CheckpointException) as e:
        raise dcp_read.refusal(where, e, "this optimizer") from None


def _with_settings(saved: dict, settings: list[dict]) -> dict:
    """``saved`` with each parameter group's settings replaced by ``settings`` (the same optimizer's groups, as
    `fitgpt.train.resume.check_same_optimizer` makes sure), its parameters and state kept."""
    groups = saved["param_groups"]
    if len(groups) != len(settings):
        return saved  # not the same optimizer's: its own load refuses it
    return {**saved, "param_groups": [{**g, **s} for g, s in zip(groups, settings)]}


def _read_whole(where: str, key: str) -> dict:
    """Entry ``key`` of a distributed checkpoint, every tensor whole, read without a model to read it into."""
    sd = dcp_read.read_whole(where, key)
    # Nested keys come back as text; an optimizer's states are keyed by parameter index.
    return {k: {int(i): s for i, s in v.items()} if k != "param_groups" and isinstance(v, dict) else v for k, v in sd.items()}


@torch.no_grad()
def init_optimizer_state(optimizer) -> None:
    """Create every state tensor an optimizer keeps, as a checkpoint is read into them: its own ``create_state``, or a
    step of zero gradients at learning rate 0, which leaves every weight bitwise as it was (and the RNG too). State
    without a tensor is not state made (APOLLO's projection seeds, set as it is built)."""
    if any(torch.is_tensor(v) for s in optimizer.state.values() if isinstance(s, dict) for v in s.values()):
        return
    if hasattr(optimizer, "create_state"):
        optimizer.create_state()
        return
    # The parameters it steps: those of its groups, or what they stand in for (pure bf16 weights' fp32 stand-ins,
    # the whole stand-ins of split ones), whose gradients its step reads.
    params = getattr(optimizer, "params", None) or [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    with torch.random.fork_rng(devices=sorted({p.device.index for p in params if p.device.type == "cuda"})):
        for g in optimizer.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
