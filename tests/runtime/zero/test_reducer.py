"""The bucket reducer: one fixed launch order, prescale, dtype round trip, staging, bounded buffers."""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.reducer import BucketReducer
from tests.distributed import run_world

SIZES = (3, 2, 5, 1, 4)  # in buckets of 6 elements: [p0 p1] [p2 p3] [p4]


def _group(world: int = 1, rank: int = 0) -> FlatGroup:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    return FlatGroup(params, [f"p{i}" for i in range(len(SIZES))], {}, world, rank, False)


def _reducer(group: FlatGroup, grads: torch.Tensor | None, **kw) -> tuple[BucketReducer, list[int]]:
    finished: list[int] = []
    kw.setdefault("prescale", 1.0)
    kw.setdefault("max_inflight", 2)
    source = None if grads is None else (lambda bi: grads[red.buckets[bi].begin:red.buckets[bi].end])
    red = BucketReducer([group], 6, kw.pop("comm_dtype", None), kw.pop("prescale"), kw.pop("max_inflight"),
                        kw.pop("world_size", 1), None, source, lambda bi, t: finished.append(bi))
    return red, finished


def test_buckets_launch_last_first_and_only_when_every_later_one_did() -> None:
    group = _group()
    red, finished = _reducer(group, torch.zeros(group.layout.padded))
    assert [b.params for b in red.buckets] == [(0, 1), (2, 3), (4,)]
    red.ready(0, 0)
    red.ready(0, 1)  # the first bucket is complete, but launches last
    assert finished == []
    red.ready(0, 4)
    assert finished == [2]
    red.ready(0, 2)  # half of bucket 1
    assert finished == [2]
    red.ready(0, 3)
    assert finished == [2, 1, 0]


def test_flush_launches_the_rest_prescaled_in_place_and_resets() -> None:
    group = _group()
    grads = torch.arange(group.layout.padded, dtype=torch.float32)
    red, finished = _reducer(group, grads, prescale=0.5)
    red.ready(0, len(SIZES) - 1)
    red.flush()
    torch.testing.assert_close(grads, torch.arange(group.layout.padded, dtype=torch.float32) * 0.5)
    assert sorted(finished) == list(range(len(red.buckets))) and red.pool.held_bytes == 0
    finished.clear()
    red.flush()  # a new round: every bucket once more
    assert finished == list(range(len(red.buckets) - 1, -1, -1))


def test_another_comm_dtype_round_trips_through_bounded_pooled_copies() -> None:
    group = _group()
    grads = torch.full((group.layout.padded,), 1.0 + 2**-12)  # not representable in bf16
    red, _ = _reducer(group, grads, comm_dtype=torch.bfloat16, max_inflight=0)
    red.flush()
    assert torch.equal(grads, torch.ones_like(grads))  # reduced in bf16, copied back
    widest = max(b.end - b.begin for b in red.buckets)
    assert red.pool.held_bytes == widest * 2  # one buffer, reused for every bucket


def test_staging_buffers_are_filled_by_the_stage_and_missing_params_by_fill() -> None:
    group = _group()
    seen: dict[int, torch.Tensor] = {}
    red = BucketReducer([group], 6, None, 1.0, 0, 1, None, None,
                        lambda bi, t: seen.__setitem__(bi, t.clone()))
    last = red.buckets[-1]
    red.staging(len(red.buckets) - 1).fill_(7.0)
    for pi in last.params:
        red.ready(0, pi)
    filled = []

    def fill(gi: int, pi: int) -> None:
        filled.append(pi)
        a, b = group.layout.param_range(pi)
        bucket = red.buckets[red.bucket_of(gi, pi)]
        red.staging(red.bucket_of(gi, pi))[a - bucket.begin:b - bucket.begin].fill_(float(pi))

    red.flush(fill)
    assert sorted(filled) == [pi for b in red.buckets[:-1] for pi in b.params]
    assert torch.equal(seen[len(red.buckets) - 1], torch.full((last.end - last.begin,), 7.0))
    for bi, b in enumerate(red.buckets[:-1]):
        want = torch.cat([torch.full((group.layout.param_range(pi)[1] - group.layout.param_range(pi)[0],),
                                     float(pi)) for pi in b.params])
        assert torch.equal(seen[bi], want)
    assert red.pool.held_bytes == max(b.end - b.begin for b in red.buckets) * 4  # every buffer came back


def _two_ranks(rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = _group(world, rank)
    grads = torch.full((group.layout.padded,), float(rank + 1))
    red, _ = _reducer(group, grads, prescale=0.25, world_size=world)
    for pi in reversed(range(len(SIZES))):  # as backward reports them
        red.ready(0, pi)
    red.flush()
    return grads.tolist()


@pytest.mark.timeout(60)
def test_two_ranks_sum_prescaled_buckets() -> None:
    for grads in run_world(_two_ranks, 2):
        assert grads == [0.25 * (1 + 2)] * len(grads)
