"""The test helper itself: results come back by rank, a failing rank fails the caller."""

import os

import pytest

from tests.distributed import run_world


def _allreduce_rank(rank: int, world: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_results_by_rank() -> None:
    assert run_world(_allreduce_rank, 3) == [6.0, 6.0, 6.0]


def test_failing_rank_is_reported() -> None:
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_world(_raise_on_rank1, 2)


def _exit_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        os._exit(3)  # a crash: no report, no traceback
    return rank


@pytest.mark.timeout(60)
def test_rank_that_exits_without_reporting_fails_the_caller_at_once() -> None:
    # not at run_world's timeout (600 s here: the test's own 60 s would end it first)
    with pytest.raises(AssertionError, match=r"ranks \[1\] exited without reporting \(exit codes rank 1: 3\)"):
        run_world(_exit_on_rank1, 2, timeout=600.0)
