"""The session's shared gloo ranks (tests/rank_pool.py, issue 47): a rank's failure fails its own test, with that
rank's traceback, and never the next test's."""

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
