"""The partition rule, bucket planning and flat layouts: disjoint, covering, in the contract's formula."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from dslaunch.runtime.zero.partition import FlatLayout, GroupLayout, partition_range, plan_buckets


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_ranges_are_disjoint_and_cover(numel: int, world: int) -> None:
    ranges = [partition_range(numel, world, r) for r in range(world)]
    k = math.ceil(numel / world)
    assert ranges[0][0] == 0 and ranges[-1][1] == numel
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:], strict=False):
        assert e0 == s1 and s0 <= e0
    assert all(e - s <= k for s, e in ranges)


def test_formula_examples() -> None:
    assert [partition_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [partition_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.integers(1, 120))
def test_buckets_hold_whole_params_and_cover(sizes: list[int], bucket: int) -> None:
    lay = GroupLayout.build([f"p{i}" for i in range(len(sizes))], [(s,) for s in sizes], 3, 1, True)
    buckets = plan_buckets(lay, bucket)
    assert buckets[0][0] == 0 and buckets[-1][1] == lay.numel
    assert [i for _, _, idx in buckets for i in idx] == list(range(len(sizes)))
    for (a, b, idx), nxt in zip(buckets, [*buckets[1:], None], strict=True):
        assert (a, b) == (lay.param_range(idx[0])[0], lay.param_range(idx[-1])[1])
        if nxt is not None:
            assert b == nxt[0]
            # a bucket holds at most `bucket` elements unless one param alone is larger, and
            # closes only when the next param would not fit
            assert b - a <= bucket or len(idx) == 1
            assert lay.param_range(nxt[2][0])[1] - a > bucket
    assert lay.padded == 3 * math.ceil(lay.numel / 3) and (lay.start, lay.end) == partition_range(lay.numel, 3, 1)


def test_flat_layout() -> None:
    assert FlatLayout.of([4, 3, 5], 0, 12).segments == ((0, 4), (1, 3), (2, 5))
    assert FlatLayout.of([4, 3, 5], 3, 8) == FlatLayout(((0, 1), (1, 3), (2, 1)), 3)
    assert FlatLayout.of([4, 3, 5], 12, 12).segments == ()
