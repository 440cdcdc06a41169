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


def _tensor(rank: int, world: int) -> "object":
    import torch

    return torch.full((1000,), float(rank))


@pytest.mark.timeout(60)
def test_a_tensor_comes_back_after_its_rank_has_exited(monkeypatch: pytest.MonkeyPatch) -> None:
    # a busy parent reads the reports late: each rank has exited by then. A tensor shared by file
    # descriptor (the queue pickler's default) was lost with its rank (FileNotFoundError in a CI run)
    import time

    import torch

    from tests import distributed

    collect = distributed._collect

    def late(procs: list, queue: object, timeout: float) -> tuple:
        deadline = time.monotonic() + 30
        while any(p.exitcode is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.exitcode == 0 for p in procs)
        return collect(procs, queue, timeout)

    monkeypatch.setattr(distributed, "_collect", late)
    got = distributed.run_world(_tensor, 2)
    assert [t.tolist() for t in got] == [[0.0] * 1000, [1.0] * 1000]
    assert all(isinstance(t, torch.Tensor) for t in got)
