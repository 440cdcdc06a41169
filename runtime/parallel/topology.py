"""Ranks on named axes: a pure map between global ranks and coordinates (DeepSpeed's
``ProcessTopology`` and its pipeline topologies, same names and results). No process group is
touched here; ``groups.py`` creates them.

- ``ProcessTopology(axes, dims)``: the last axis varies fastest (rank = row-major index of the
  coordinate).
- ``PipeDataParallelTopology(num_pp, num_dp)`` (axes ``pipe, data``) and
  ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes ``pipe, data, model``; ``model``
  is the tensor axis, named as DeepSpeed names it in checkpoint files).
- ``default_topology(world)``: DeepSpeed's pipe x data factoring of a world without a topology.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from dslaunch.errors import UsageError, quote

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "default_topology"]


class ProcessTopology:
    """Global ranks on the Cartesian product of ``axes`` (sizes ``dims``), last axis fastest.

    Raises:
        UsageError: axes not distinct identifiers, lengths that differ, or a size below 1.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]):
        axes, dims = list(axes), [int(d) for d in dims]
        if len(axes) != len(dims) or len(set(axes)) != len(axes) or not all(a.isidentifier() for a in axes):
            raise UsageError(f"ProcessTopology: axes {quote(axes)} must be distinct names, one per size in "
                             f"{quote(dims)}")
        if any(d < 1 for d in dims):
            raise UsageError(f"ProcessTopology: every axis needs at least one rank, got sizes {quote(dims)}")
        self.axes, self.dims = axes, dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # DeepSpeed's attribute name
        coords = itertools.product(*(range(d) for d in dims))
        self.mapping: dict[Any, int] = {self.ProcessCoord(*c): rank for rank, c in enumerate(coords)}
        self._coords = list(self.mapping)  # by rank

    def get_rank(self, **coord_kwargs: int) -> int:
        """The global rank at a full coordinate (every axis named)."""
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank() needs every axis of {self.axes}, got {sorted(coord_kwargs)}")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside the topology {self.shape()}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return list(self.axes)

    def shape(self) -> dict[str, int]:
        """Each axis' size, in axis order (for messages and the checkpoint manifest)."""
        return dict(zip(self.axes, self.dims, strict=True))

    def get_rank_repr(self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_",
                      outer_sep: str = "-") -> str:
        """``"model_01"``-style name of ``rank`` over the axes not omitted (checkpoint file names)."""
        coord = self.get_coord(rank)
        return outer_sep.join(f"{a}{inner_sep}{getattr(coord, a):02d}" for a in self.axes if a not in omit_axes)

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (DeepSpeed's answer)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that communicate along ``axis``: one per coordinate of the other axes, in
        topology order (the order every rank creates their groups in); [] for an unknown axis."""
        return self.comm_lists([axis]) if axis in self.axes else []

    def comm_lists(self, axes: Sequence[str]) -> list[list[int]]:
        """The rank lists that vary over ``axes`` together (the others fixed): one per coordinate
        of the other axes, in topology order, each in rank order. Axes not in the topology are
        size 1 (each rank alone when none is)."""
        inner = [a for a in self.axes if a in axes]
        others = [a for a in self.axes if a not in axes]
        lists = []
        for rest in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, rest, strict=True))
            lists.append(sorted(self.mapping[self.ProcessCoord(**fixed, **dict(zip(inner, mine, strict=True)))]
                                for mine in itertools.product(*(range(self.get_dim(a)) for a in inner))))
        return lists

    def split(self, axis: str, outer: str, inner: str, inner_size: int) -> ProcessTopology:
        """The same ranks with ``axis`` cut into ``outer`` x ``inner`` (``inner`` fastest): rank
        numbers do not move, since the two new axes sit where ``axis`` was.

        Raises:
            UsageError: ``inner_size`` does not divide the axis.
        """
        size = self.get_dim(axis)
        if inner_size < 1 or size % inner_size:
            raise UsageError(f"ProcessTopology: {inner} size {inner_size} does not divide the {axis} axis of "
                             f"{size} ranks")
        at = self.axes.index(axis)
        return ProcessTopology(self.axes[:at] + [outer, inner] + self.axes[at + 1:],
                               self.dims[:at] + [size // inner_size, inner_size] + self.dims[at + 1:])

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """The ranks whose coordinate has every given axis value, in rank order."""
        return [r for c, r in self.mapping.items() if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """The ranks whose ``axis`` coordinate is ``idx``."""
        i = self.axes.index(axis)
        return [r for c, r in self.mapping.items() if c[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self) -> str:
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline stages x data-parallel replicas; the data axis is the fastest (neighbouring ranks
    are replicas of one stage, so gradient all-reduces stay within a node)."""

    def __init__(self, num_pp: int, num_dp: int):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x tensor slices (model axis fastest, as Megatron places tensor parallelism)."""

    def __init__(self, num_pp: int, num_mp: int, num_dp: int):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def default_topology(world_size: int) -> ProcessTopology:
    """DeepSpeed's default when no topology is given: the world's prime factors dealt alternately
    to the pipe and data axes (12 = 2*2*3: pipe 2*3, data 2)."""
    pp = dp = 1
    for i, prime in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            pp *= prime
        else:
            dp *= prime
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


def _prime_factors(n: int) -> list[int]:
    """[2, 2, 3] for 12 (ascending); [] for 1.

    Raises:
        ValueError: ``n`` below 1 (it has no factorisation; the loop would return [] silently).
    """
    if n < 1:
        raise ValueError(f"prime factors of {n}: need an integer >= 1")
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


