"""Work forked beside this process (``fitgpt.utils.Forked``): its result, its errors, and a child stopped when unwanted."""

import os
import signal
import time

import pytest

from fitgpt.errors import UserError
from fitgpt.utils import Forked


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


def _sleeps():
    time.sleep(60)


def test_the_result_comes_from_another_process():
    with Forked(_pid_and, 21) as job:
        pid, value = job.result()
    assert (value, pid != os.getpid()) == (42, True)


def test_the_childs_error_is_raised_here_as_it_was():
    with Forked(_fails) as job, pytest.raises(UserError, match="change --flag"):
        job.result()


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
