"""The test helper itself: results come back by rank, a failing rank fails the caller."""

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
