"""The session's shared gloo ranks (tests/rank_pool.py, issue 47): a rank's failure fails its own test, with that
rank's traceback, and never the next test's; a command run on them as torchrun runs it meets in a group of its own."""

import os
import signal

import pytest
import torch.distributed as dist


def _fails_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank one's own failure")
    dist.barrier()  # rank 0 waits in a collective the failed rank never joins


def _rank(rank: int, world: int) -> tuple[int, int]:
    return rank, dist.get_world_size()


@pytest.mark.slow
def test_a_failing_rank_fails_its_own_test_with_its_traceback_and_the_next_gets_new_ranks(ranks):
    with pytest.raises(AssertionError, match="_fails_on_rank_one, rank 1 of 2") as failed:
        ranks(2).run(_fails_on_rank_one)
    assert "ValueError: rank one's own failure" in str(failed.value)
    assert ranks(2).run(_rank) == [(0, 2), (1, 2)]  # rank 0, left waiting, was ended with its group


def _dies_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as a native abort ends a process: no traceback, no answer
    dist.barrier()


@pytest.mark.slow
def test_a_rank_whose_process_dies_fails_its_test_at_once_and_the_next_gets_new_ranks(ranks):
    """Rank 1 of a CI run died of "malloc(): unaligned tcache chunk detected" and its test waited out its 300 s; a dead
    process is now told within a second, by name (and fails its test: nothing is rerun)."""
    from rank_pool import RankCrashed

    with pytest.raises(RankCrashed, match=r"_dies_on_rank_one on 2 ranks: the process of rank\(s\) \[1\] died .*-9"):
        ranks(2).run(_dies_on_rank_one, timeout=60)
    assert ranks(2).run(_rank) == [(0, 2), (1, 2)]


@pytest.mark.slow
def test_a_body_left_uncollected_ends_its_group_and_the_next_test_gets_new_ranks(ranks):
    """A test that fails between ``submit`` and ``result`` leaves its body's answers behind: they must never be the next
    test's, and its ranks never be asked for another body while they work on the first."""
    first = ranks(2)
    first.submit(_rank)  # its test failed here, before collecting
    with pytest.raises(RuntimeError, match="_rank is still running on these ranks: collect it first"):
        first.submit(_rank)
    assert ranks(2) is not first and not first.procs[0].is_alive()
    ports = ranks(2).run(_group_port)
    assert ports[0] == ports[1] and isinstance(ports[0], str)  # its own answers, not the body left behind's (rank, world)


def _group_port(rank: int, world: int) -> str:
    dist.barrier()
    return os.environ["MASTER_PORT"]


@pytest.mark.slow
def test_a_command_on_the_ranks_meets_in_its_own_group_and_says_what_torchrun_would(ranks, tmp_path):
    """``pool.cli(argv)``: the ranks' output, rank by rank, as torchrun's; a rank's non-zero exit fails the test with
    its one line; before and after a command the ranks' own bodies run in a group of their own."""
    pool = ranks(2)
    before = pool.run(_group_port)
    out, _ = pool.cli(["plan", "--preset", "tiny", "--memory-budget", "64MiB", "--batch-size", "2"])
    assert out.count("| policy | predicted peak |") == 2  # each rank printed its plan, rank 0's first
    after = pool.run(_group_port)
    assert before[0] == before[1] and after[0] == after[1] and after != before  # a new group after the command's
    with pytest.raises(AssertionError, match=r"(?s)fitgpt train on 2 ranks exited \[2, 2\]:.*set --max-steps"):
        pool.cli(["train", "--max-steps", "0", "--out-dir", str(tmp_path / "run")])
