"""Work forked beside this process (``fitgpt.utils.Forked``): its result, its errors, and a child stopped when unwanted.
Searches side by side in spawned processes (``fitgpt.utils.in_processes``): kept between calls, replaced when broken."""

import os
import signal
import time
from concurrent.futures.process import BrokenProcessPool

import pytest

from fitgpt.errors import UserError
from fitgpt.utils import Forked, in_processes


def _pid_and(x):
    return os.getpid(), x * 2


def _fails():
    raise UserError("change --flag")


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("not picklable")


def _fails_unpicklably():
    raise _Unpicklable("the reason")


def _killed():
    os.kill(os.getpid(), signal.SIGKILL)


def _slow():
    time.sleep(0.5)
    return 1


def _sleeps():
    time.sleep(60)


def test_the_result_comes_from_another_process():
    with Forked(_pid_and, 21) as job:
        pid, value = job.result()
    assert (value, pid != os.getpid()) == (42, True)


def test_the_childs_error_is_raised_here_as_it_was():
    with Forked(_fails) as job, pytest.raises(UserError, match="change --flag") as raised:
        job.result()
    assert str(raised.value) == "change --flag"  # the one-line message the CLI prints
    assert "in _fails" in raised.value.__notes__[0]  # the child's traceback, for --verbose


def test_an_error_that_cannot_be_pickled_arrives_as_its_text():
    with Forked(_fails_unpicklably) as job, pytest.raises(RuntimeError, match="_Unpicklable: the reason"):
        job.result()


def test_a_child_that_dies_is_an_error_that_says_how():
    with Forked(_killed) as job, pytest.raises(RuntimeError, match="exit code -9 .killed: out of memory"):
        job.result()


def test_a_child_whose_result_is_not_taken_is_stopped():
    t0 = time.monotonic()
    with Forked(_sleeps) as job:
        pid = job.pid
    assert time.monotonic() - t0 < 30
    with pytest.raises(ChildProcessError):  # reaped: no such child any more
        os.waitpid(pid, os.WNOHANG)


def test_on_one_cpu_the_work_runs_here(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0})
    with Forked(_pid_and, 1) as job:
        assert job.pid is None
        assert job.result() == (os.getpid(), 2)


def test_a_child_that_cannot_send_its_result_never_returns_into_the_callers_code(tmp_path):
    parent = os.getpid()
    try:
        job = Forked(_slow)
    except BaseException:
        if os.getpid() != parent:  # a child that escaped its work: it would run the rest of this process's program
            (tmp_path / "escaped").write_text("")
            os._exit(0)
        raise
    os.close(job._read)  # the result has nowhere to go: the child's write fails
    os.waitpid(job.pid, 0)
    job.pid = None
    assert not (tmp_path / "escaped").exists()


def _pid_or_killed(x):
    if x is None:
        os.kill(os.getpid(), signal.SIGKILL)
    return os.getpid(), x * 2


@pytest.mark.slow  # spawned workers: a Python and torch start-up each
def test_searches_side_by_side_keep_their_processes_for_the_next_call():
    """A spawned worker's start-up (Python and torch, 3-4 s here) is paid once a session, not once a call; a worker
    killed mid-job fails that call in a clear error, and the next call gets new workers."""
    first = in_processes(_pid_or_killed, [(1,), (2,), (3,), (4,)], workers=2)
    assert [v for _, v in first] == [2, 4, 6, 8] and os.getpid() not in {pid for pid, _ in first}
    again = in_processes(_pid_or_killed, [(5,), (6,)], workers=2)
    assert {pid for pid, _ in again} <= {pid for pid, _ in first}
    with pytest.raises(BrokenProcessPool):
        in_processes(_pid_or_killed, [(None,), (7,)], workers=2)
    after = in_processes(_pid_or_killed, [(8,), (9,)], workers=2)
    assert [v for _, v in after] == [16, 18] and not {pid for pid, _ in after} & {pid for pid, _ in first}
    # A worker's error that cannot be pickled arrives as its text (it broke the pool's own result: a traceback of
    # pickling, `fit --world-size 2 --model.weights-dtype bf16` in issue 68), and a user error as itself.
    with pytest.raises(RuntimeError, match="_Unpicklable: the reason"):
        in_processes(_unpicklable_or, [(None,), (10,)], workers=2)
    with pytest.raises(UserError, match="change --flag"):
        in_processes(_unpicklable_or, [("user",), (11,)], workers=2)


def _unpicklable_or(x):
    if x is None:
        _fails_unpicklably()
    if x == "user":
        _fails()
    return os.getpid(), x * 2
