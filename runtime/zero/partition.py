"""How a param group is laid out flat and split across ranks (the ZeRO partition rule).

Owns the ONE partition rule every stage and the checkpoint code share (``partition_range``), the
flat layout of a param group (``GroupLayout``: names, shapes, offsets; its storage is
``flat.FlatGroup``), which original parameters a flat tensor or shard holds (``FlatLayout``, for
optimizers with per-parameter norms such as Lamb), and bucket planning. Torch-free.

Layout: the params of a group are concatenated, in group order, into a vector of ``numel``
elements, padded to ``k * world_size`` (``k = ceil(numel / world_size)``) so every rank's shard
has a fixed slot of ``k`` elements; rank ``r`` owns ``partition_range(numel, world, r)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["partition_range", "shard_slot", "GroupLayout", "FlatLayout", "plan_buckets"]


def partition_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """The [start, end) slice of a flat group of ``numel`` elements that ``rank`` owns.

    k = ceil(numel / world_size); start = min(rank * k, numel); end = min(start + k, numel).
    The last ranks may own fewer (or zero) elements.
    """
    k = shard_slot(numel, world_size)
    start = min(rank * k, numel)
    return start, min(start + k, numel)


def shard_slot(numel: int, world_size: int) -> int:
    """Elements reserved per rank in the padded flat buffer: ceil(numel / world_size)."""
    return max(1, math.ceil(numel / world_size))


@dataclass(frozen=True)
class GroupLayout:
    """Where each param of one group lives in the flat vector, and which part this rank owns."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int
    start: int  # this rank's owned range [start, end)
    end: int
    padded: int  # flat buffer length: k * world_size (numel when not partitioned)

    @classmethod
    def build(cls, names: list[str], shapes: list[tuple[int, ...]], world_size: int, rank: int,
              partitioned: bool) -> GroupLayout:
        sizes = [math.prod(s) for s in shapes]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        numel = sum(sizes)
        if partitioned:
            start, end = partition_range(numel, world_size, rank)
            padded = shard_slot(numel, world_size) * world_size
        else:
            start, end, padded = 0, numel, numel
        return cls(tuple(names), tuple(tuple(s) for s in shapes), tuple(offsets), numel, start, end,
                   padded)

    def param_range(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i] + math.prod(self.shapes[i])

    def counted_pieces(self, skipped: Sequence[int]) -> list[tuple[int, int]] | None:
        """The pieces of this rank's range [start, end) that count in the global gradient norm,
        relative to ``start``, leaving out the params ``skipped`` (another rank counts them);
        None: the whole range counts (no piece to cut, nothing extra per step)."""
        cut = [(max(a, self.start), min(b, self.end)) for a, b in map(self.param_range, skipped)]
        cut = sorted((a, b) for a, b in cut if b > a)
        if not cut:
            return None
        pieces, at = [], self.start
        for a, b in cut:
            if a > at:
                pieces.append((at - self.start, a - self.start))
            at = max(at, b)
        if self.end > at:
            pieces.append((at - self.start, self.end - self.start))
        return pieces

    def rank_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """Slot of ``rank`` in the padded buffer (k elements; may extend past numel)."""
        k = self.padded // world_size
        return rank * k, (rank + 1) * k


@dataclass(frozen=True)
class FlatLayout:
    """Which original parameters a flat tensor holds: ``(param_id, length)`` pieces, in order.

    ``num_params`` is the group's parameter count on every rank (the size of the norm vector
    that is all-reduced, so it must not depend on the rank's shard).
    """

    segments: tuple[tuple[int, int], ...]
    num_params: int

    @classmethod
    def of(cls, numels: Sequence[int], start: int, end: int) -> FlatLayout:
        """The layout of [start, end) of the group's params flattened in order.

        Args:
            numels: element counts of the group's parameters, in flattening order.
            start, end: the range the tensor holds (``0, sum(numels)`` without sharding).
        """
        segments, offset = [], 0
        for param_id, numel in enumerate(numels):
            lo, hi = max(start, offset), min(end, offset + numel)
            if hi > lo:
                segments.append((param_id, hi - lo))
            offset += numel
        return cls(tuple(segments), len(numels))

    @property
    def bounds(self) -> list[int]:
        """Where each segment starts in the flat tensor, then where the last ends:
        ``[0, l0, l0 + l1, ...]`` (segment ``i`` is ``[bounds[i], bounds[i + 1])``)."""
        return [0, *itertools.accumulate(length for _, length in self.segments)]


def plan_buckets(layout: GroupLayout, bucket_numel: int) -> list[tuple[int, int, tuple[int, ...]]]:
    """Split a group's params, in flat order, into buckets of whole params.

    Returns ``[(begin, end, param_indices)]`` covering [0, numel). A bucket takes params while
    they fit in ``bucket_numel`` elements (a larger param gets a bucket of its own): smaller
    buckets launch earlier during backward and leave less communication after it.
    """
    buckets: list[tuple[int, int, tuple[int, ...]]] = []
    begin, members = 0, []
    for i in range(len(layout.shapes)):
        a, b = layout.param_range(i)
        if members and b - begin > bucket_numel:
            buckets.append((begin, a, tuple(members)))
            begin, members = a, []
        members.append(i)
    if members:
        buckets.append((begin, layout.numel, tuple(members)))
    return buckets
