"""Gloo ranks started once per world size and kept for the session (issue 47): a test hands the group a function,
every rank runs it in its initialised process group, and the test gets each rank's return value, or the failing
rank's traceback as its own failure.

Each launch of ranks paid a Python and torch start-up a process and a rendezvous (about 4-8 s on 2 cores) before
its first line of work; the tests that compare ranks with one process now pay it once per world size. A failure or
a timeout ends the group (the other ranks may be left waiting in a collective) and the next test starts a new one,
so one test's failure is never another's. A rank whose process dies (a native crash) is told within a second, as
``RankCrashed``, not at the timeout. Tests that kill or stop a process, or test the launcher itself, keep their
own processes under torchrun.

``pool.submit(fn, *args)`` starts a body and returns at once: the test computes its own side of the comparison (the
prediction, one process's step) while the ranks work, then collects them with ``.result()``.

``pool.cli(argv)`` runs ``fitgpt ARGV`` on every rank as ``torchrun -m fitgpt ARGV`` would: the pool's group is
left, the command meets its own group through the environment torchrun sets (a new port each time), and the ranks'
output comes back as torchrun's would, rank by rank. Every rank computes with one intra-op thread, torchrun's default.

A body is ``fn(rank, world, *args)``, a module-level function (the ranks import it by name): it builds its own
meshes and models, leaves the default process group as it found it, and returns what its test checks (tensors are
carried back with ``torch.save``)."""

from __future__ import annotations

import contextlib
import io
import os
import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp
from hang import guard

_ctx = mp.get_context("spawn")


def free_port() -> int:
    """A port free on this machine now (the OS picks it), for a group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world: int, inbox, outbox, threads: int) -> None:
    import torch.distributed as dist

    from fitgpt.train.distributed import forget_sharding

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # One intra-op thread a rank, as torchrun starts its workers (OMP_NUM_THREADS=1): 4 ranks of 2 OpenMP threads each
    # on 2 cores spun against each other, and the ranks' tests took 1.8x as long.
    torch.set_num_threads(threads)
    while (job := inbox.get()) is not None:
        fn, args, port = job
        # Each body meets DTensor's caches empty: a mesh an earlier body left there, its groups since destroyed, would
        # be handed to this body's equal mesh ("could not resolve the process group", PyTorch 2.13).
        forget_sharding()
        os.environ["MASTER_PORT"] = str(port)  # where a group the ranks meet in anew meets (an existing one stays)
        try:
            # The session's first body, or the first after a command that met in a group of its own
            if not dist.is_initialized() and fn is not _cli:
                dist.init_process_group("gloo")
            buf = io.BytesIO()
            torch.save(fn(rank, world, *args), buf)
            outbox.put((rank, None, buf.getvalue()))
        except BaseException:
            outbox.put((rank, traceback.format_exc(), None))
    # Out at once: tearing gloo ranks down on 2 cores aborted one now and then (SIGABRT), after its work was done.
    os._exit(0)


def _cli(rank: int, world: int, argv: list[str]) -> tuple[int, str, str]:
    """``fitgpt ARGV`` on this rank, as a rank torchrun started: it meets the others in a group of its own."""
    import torch.distributed as dist

    from fitgpt.cli import main
    from fitgpt.train.distributed import release_meshes

    if dist.is_initialized():
        dist.destroy_process_group()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        if dist.is_initialized():  # a command that stopped before its own teardown
            dist.destroy_process_group()
            release_meshes()
    return code, out.getvalue(), err.getvalue()


class RankCrashed(RuntimeError):
    """A rank's process died before it answered (a signal, or a native abort). No test is rerun for it: a crash is a
    failure (issue 68 found the cause of the aborts seen at a run's end: process groups kept alive by DTensor's caches,
    `fitgpt.train.distributed.shutdown`)."""


class RankPool:
    """``world`` gloo ranks waiting for work: ``pool.run(fn, *args)`` -> each rank's return value, in rank order."""

    def __init__(self, world: int, threads: int = 1):
        self.world = world
        self.inboxes = [_ctx.Queue() for _ in range(world)]
        self.outbox = _ctx.Queue()
        self.procs = [_ctx.Process(target=_serve, args=(r, world, self.inboxes[r], self.outbox, threads),
                                  daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.pending = None
        """The body submitted and not yet collected."""

    @property
    def ready(self) -> bool:
        """Every rank alive and waiting for work."""
        return self.pending is None and all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        return self.submit(fn, *args, timeout=timeout).result()

    def submit(self, fn, *args, timeout: float = 120.0) -> Submitted:
        """``fn`` started on every rank while this process works on (the one-process side of a comparison, on the
        cores the ranks leave idle); ``.result()`` is then what ``run`` returns. A body left uncollected (its test
        failed first) ends the group, and the next test gets new ranks."""
        if self.pending is not None:
            raise RuntimeError(f"{self.pending.__name__} is still running on these ranks: collect it first")
        port = free_port()
        for inbox in self.inboxes:
            inbox.put((fn, args, port))
        self.pending = fn
        return Submitted(self, fn, guard(timeout))  # seconds on a quiet machine; the bound is a hang guard

    def _collect(self, fn, timeout: float) -> list:
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world:
            try:  # a second at a time: a rank whose process died answers nothing, and is told at once
                rank, error, value = self.outbox.get(timeout=1.0)
            except queue.Empty:
                self._raise_if_dead(fn, results)
                if time.monotonic() > deadline:
                    self.close()
                    raise TimeoutError(f"{fn.__name__} on {self.world} ranks: ranks "
                                       f"{sorted(set(range(self.world)) - set(results))} gave nothing within {timeout:.0f} s") from None
                continue
            if error is not None:
                for r, p in enumerate(self.procs):  # a peer's death is the cause of a lost connection: name it
                    if r != rank and r not in results:
                        p.join(timeout=0.5)
                self._raise_if_dead(fn, {**results, rank: None})
                self.close()  # the others may wait in a collective the failed rank never joins
                raise AssertionError(f"{fn.__name__}, rank {rank} of {self.world}:\n{error}")
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        self.pending = None
        return [results[r] for r in range(self.world)]

    def _raise_if_dead(self, fn, results: dict) -> None:
        dead = {r: p.exitcode for r, p in enumerate(self.procs) if r not in results and p.exitcode is not None}
        if dead:
            self.close()
            raise RankCrashed(f"{fn.__name__} on {self.world} ranks: the process of rank(s) {sorted(dead)} died before "
                              f"answering (exit codes {sorted(dead.values())}; its own message, if any, is in this test's "
                              "captured stderr)")

    def cli(self, argv: list[str], timeout: float = 300.0) -> tuple[str, str]:
        """``torchrun --nproc-per-node WORLD -m fitgpt ARGV`` on these ranks: its standard output and error, each
        rank's in turn; a rank that exits non-zero fails the test with its error's tail, and ends the group."""
        results = self.run(_cli, [str(a) for a in argv], timeout=timeout)
        codes = [code for code, _, _ in results]
        if any(codes):
            self.close()
            raise AssertionError(f"fitgpt {argv[0]} on {self.world} ranks exited {codes}:\n"
                                 + "".join(err for _, _, err in results)[-3000:])
        return "".join(out for _, out, _ in results), "".join(err for _, _, err in results)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=10)


class Submitted:
    """A body running on the ranks: ``.result()`` waits for each rank's return value (`RankPool.run`)."""

    def __init__(self, pool: RankPool, fn, timeout: float):
        self.pool, self.fn, self.timeout = pool, fn, timeout

    def result(self) -> list:
        return self.pool._collect(self.fn, self.timeout)


class RankPools:
    """One pool a world size, started on first use, a new one where the last failed; all closed at the session's end."""

    def __init__(self, threads: int = 1):
        self.pools: dict[int, RankPool] = {}
        self.threads = threads
        """Each rank's intra-op threads."""

    def __call__(self, world: int) -> RankPool:
        pool = self.pools.get(world)
        if pool is None or not pool.ready:
            if pool is not None:
                pool.close()
            pool = self.pools[world] = RankPool(world, self.threads)
        return pool

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
