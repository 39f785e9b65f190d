"""Small helpers shared across the package: file hashes, processes (searches run side by side in several; work forked
beside this process), directory locks."""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from fitgpt.errors import UserError


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_error(e: BaseException, where: str | Path) -> str:
    """A one-line reason for a failed write. Writers report a full disk differently (numpy: "N requested and M
    written", torch.save: a RuntimeError from its zip writer), so the free space is looked at too."""
    reason = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0]
    if "No space left" not in reason:
        try:
            if shutil.disk_usage(where).free < (1 << 20):
                reason = f"No space left on device ({reason})"
        except OSError:
            pass
    return reason


def writable_dir(out: Path, flag: str) -> Path:
    """Create folder ``out`` if need be and prove it can be written, before any work whose result goes there; a
    UserError naming ``flag`` if it is a file or cannot be written."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file; choose a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".fitgpt-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write to {flag} {out} ({write_error(e, out if out.exists() else out.parent)}); "
                         "choose a writable folder") from None
    return out


def outputs_apart(inputs: dict[str, str | None], outputs: list[tuple[str, str | Path | None]]) -> None:
    """Refuse a command whose output would replace one of its own inputs (``--compare X --memory-snapshot X``), before
    anything is written: one line naming both flags. ``outputs``: (flag, a file it writes), a folder's files each."""
    for out_flag, out in outputs:
        for in_flag, given in inputs.items():
            if out is None or not given:
                continue
            if _same_file(Path(given), Path(out)):
                raise UserError(f"{out_flag} would overwrite {given}, the file {in_flag} reads; write it elsewhere")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists() and os.path.samefile(a, b))
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class DirLock:
    """An exclusive OS-level lock on a directory, held while fitgpt writes into it.

    ``flock`` is released by the kernel when the holder exits, however it dies, so a crashed run
    never blocks the next one. The lock file holds the holder's pid for the message.
    """

    FILE = ".fitgpt-lock"

    def __init__(self, directory: str | Path, flag: str) -> None:
        self.dir = Path(directory)
        self.flag = flag
        self._fd: int | None = None

    def __enter__(self) -> DirLock:
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.dir / self.FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UserError(f"cannot write to {self.dir} ({e.strerror}); choose a writable {self.flag}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if holder == str(os.getpid()):
                raise UserError(f"{self.dir} is already in use by this run for another purpose; give {self.flag} "
                                 "a directory of its own") from None
            raise UserError(f"{self.dir} is in use by another fitgpt process (pid {holder}); wait for it to end, "
                             f"or use another {self.flag}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def process_age(pid: int | str = "self") -> float:
    """Seconds since process ``pid`` (this one) started (its interpreter's start-up and imports included), from
    Linux's /proc; 0 where that cannot be read."""
    try:
        start_ticks = float(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def launch_age() -> float:
    """Seconds since this command was launched: this process's age, or under torchrun (its first attempt) its
    launcher's, whose own start-up and the workers' start count against a --time-budget too (they ended 2-4 s past
    it). A restarted attempt counts from its own start: its checkpoint holds the time spent before."""
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return max(process_age(), process_age(os.getppid()))
    return process_age()


def host_memory() -> int:
    """This machine's physical memory in bytes, as the OS reports it."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def in_processes(fn, jobs: list[tuple], workers: int | None = None) -> list:
    """``fn(*job)`` for each job, the results in the jobs' order: in spawned processes (``workers``, default one per
    CPU core, at most one per job) where there are several jobs and cores, so that independent single-threaded searches
    on fake tensors run side by side; here otherwise. Jobs start in the order given: put the slowest first.

    The processes are kept for the next call (``_POOLS``): a spawned worker pays a Python and torch start-up (3-4 s on
    2 cores) before its first job, and a session that searches many times (a notebook, the test suite) pays it once."""
    n = min(len(jobs), workers or os.cpu_count() or 1)
    if n <= 1:
        return [fn(*job) for job in jobs]
    pool = _POOLS.get(n)
    if pool is None:
        # Spawned, not forked: a forked worker is safe only for work like Forked's (fake tensors, one intra-op thread).
        pool = _POOLS[n] = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
    try:
        # Each worker sends its outcome already pickled (`_outcome`): an error that cannot be pickled arrives as its
        # text (it once broke the pool's own result, a traceback of pickling in place of the error).
        outcomes = [pickle.loads(b) for b in pool.map(_outcome, [fn] * len(jobs), jobs, [None] * len(jobs))]
    except BrokenProcessPool:  # a worker died (killed, out of memory): the next call starts a new pool
        _POOLS.pop(n, None)
        raise
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


_POOLS: dict[int, ProcessPoolExecutor] = {}
"""``in_processes``' worker pools by size, kept between calls; a broken one is replaced."""


class Forked:
    """``fn(*args)`` started in a forked copy of this process, to run beside what this process does next: a copy that
    shares everything built so far (fake models, a fake process group) at no cost. ``result()`` waits for its
    return value, or raises its error. Used as a context manager, a child whose result was not taken is stopped.

    Only on Linux with two CPUs or more (elsewhere ``fn`` runs here, at once: macOS's system frameworks are not safe to
    fork, which is why Python spawns there). For work on fake tensors: the child computes with one intra-op thread, as
    DataLoader's forked workers do, because an OpenMP pool the parent started does not survive a fork."""

    def __init__(self, fn, *args, fresh: bool = False) -> None:
        """``fresh``: forked on one CPU too, where what is wanted is a copy of this process to change as it likes (its
        own fake process group), not the time."""
        self.pid = None
        if not sys.platform.startswith("linux") or (len(os.sched_getaffinity(0)) < 2 and not fresh):
            self._value = (True, fn(*args))
            return
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its result, or its error, down the pipe; then gone without running exit handlers
            try:
                os.close(read)
                with os.fdopen(write, "wb") as out:
                    out.write(_outcome(fn, args))
            finally:
                os._exit(0)  # whatever happened: the child never returns into the parent's code
        os.close(write)
        self.pid, self._read = pid, read

    def fileno(self) -> int:
        """The pipe its result comes down (readable once the copy has finished), for ``select``."""
        return self._read

    def result(self) -> Any:
        if self.pid is not None:
            with os.fdopen(self._read, "rb") as f:
                data = f.read()
            _, status = os.waitpid(self.pid, 0)
            self.pid = None
            code = os.waitstatus_to_exitcode(status)
            self._value = pickle.loads(data) if data else (False, RuntimeError(
                f"a forked copy of this process ended without a result, exit code {code}"
                f"{' (killed: out of memory?)' if code == -signal.SIGKILL else ''}"))
        ok, value = self._value
        if not ok:
            raise value
        return value

    def __enter__(self) -> Forked:
        return self

    def __exit__(self, *exc) -> None:
        if self.pid is not None:  # the parent failed before taking the result
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            os.close(self._read)
            self.pid = None


def _outcome(fn, args, threads: int | None = 1) -> bytes:
    """``(True, fn(*args))`` pickled, or ``(False, its error)`` (its text where the error cannot be pickled), computed
    with ``threads`` intra-op threads (None: as they are)."""
    import torch  # here, not at the top: this module stays light for the commands that need no torch

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return pickle.dumps((True, fn(*args)))
    except BaseException as e:  # noqa: BLE001 - whatever ended the child is the parent's to raise
        e.add_note(f"raised in another process:\n{traceback.format_exc()}")  # shown with --verbose
        try:
            return pickle.dumps((False, e))
        except Exception:  # noqa: BLE001
            return pickle.dumps((False, RuntimeError(f"{type(e).__name__}: {e}")))


TORCHAO_NOISE = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree")
"""What torchao's import warns through: its compiled kernels for each CUDA architecture this build or machine cannot
load, Triton's absence (its int8 matmuls), and an Enum it registers with torch's pytree, which now says it need not.
fitgpt calls none of those kernels (the Python paths of --float8 and low-bit AdamW are what it runs)."""


def import_torchao(name: str):
    """``import name`` (a torchao module), without the warnings of ``TORCHAO_NOISE`` (in every process that imports
    it: the planner's spawned workers too). Raises ImportError as the import does."""
    loggers = [logging.getLogger(n) for n in TORCHAO_NOISE]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        return importlib.import_module(name)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
