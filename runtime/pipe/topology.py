"""Ranks arranged on named axes, and the process groups of each axis (DeepSpeed's
``deepspeed.runtime.pipe.topology``, same names and results).

- ``ProcessTopology(axes, dims)``: a pure map between global ranks and coordinates; the last axis
  varies fastest (rank = row-major index of the coordinate). No process group is touched.
- ``PipeDataParallelTopology(num_pp, num_dp)`` (axes ``pipe, data``) and
  ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` (axes ``pipe, data, model``).
- ``PipelineParallelGrid(topology)``: the process groups of a topology, with the Megatron "mpu"
  methods the engine reads (``get_data_parallel_group/rank/world_size``,
  ``get_model_parallel_*``: the model-parallel group is every rank of one data-parallel index,
  i.e. all pipeline stages and tensor slices of one replica), plus the pipe and slice groups.
- ``DataParallelGrid()``: the same methods for the one-axis case (every rank a data-parallel peer,
  the world group itself): no group is created, so a job without model parallelism pays nothing.

Every rank must build a grid at the same point, with the same topology: ``new_group`` is collective
over the world and groups are created in one fixed order (axis by axis, lists in topology order).
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

from dslaunch.errors import UsageError, quote

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology",
           "PipelineParallelGrid", "DataParallelGrid"]


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
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for rest in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, rest, strict=True))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

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


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("a process grid needs torch.distributed: call deepspeed.init_distributed() first")
    return dist


class DataParallelGrid:
    """The one-axis grid: every rank a data-parallel peer in the world group; no model parallelism.

    The engine reads this when no ``mpu`` and no pipeline topology is given. It creates no group.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._topo = PipeDataParallelTopology(1, self.world_size)

    def topology(self) -> ProcessTopology:
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_group(self) -> Any:
        return None  # the default (world) group

    def get_data_parallel_rank(self) -> int:
        return self.global_rank

    def get_data_parallel_world_size(self) -> int:
        return self.world_size

    def get_model_parallel_group(self) -> Any:
        return None

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_pipe_parallel_rank = get_slice_parallel_rank = get_model_parallel_rank
    get_pipe_parallel_world_size = get_slice_parallel_world_size = get_model_parallel_world_size
    get_pipe_parallel_group = get_slice_parallel_group = get_model_parallel_group


class PipelineParallelGrid:
    """The process groups of ``topology`` (default: a pipe x data topology that factors the world
    as DeepSpeed's does) and the mpu methods over them.

    collective: construct on every rank of the world, with the same topology.

    Raises:
        UsageError: torch.distributed not initialised, or a topology whose size is not the world's.
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        dist = _dist()
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._topo = topology if topology is not None else _default_topology(self.world_size)
        if self._topo.world_size() != self.world_size:
            raise UsageError(f"the topology has {self._topo.world_size()} ranks ({self._topo.shape()}) but the "
                             f"world has {self.world_size}")
        self.data_parallel_size = max(self._topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(self._topo.get_dim("pipe"), 1)
        self.model_parallel_size = self.slice_parallel_size = max(self._topo.get_dim("model"), 1)
        coord = self._topo.get_coord(self.global_rank)
        self.stage_id = getattr(coord, "pipe", 0)
        self.data_parallel_id = getattr(coord, "data", 0)
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        # One replica's ranks (every stage and slice of one data index): overflow and norm agree here.
        replicas = [sorted(self._topo.get_axis_list("data", d)) if "data" in self._topo.axes
                    else list(range(self.world_size)) for d in range(self.data_parallel_size)]
        self.ds_model_proc_group, self.ds_model_ranks = _my_group(dist, replicas, self.global_rank)
        self.dp_proc_group, self.dp_group = _my_group(dist, self._axis_lists("data"), self.global_rank)
        self.pp_proc_group, self.pp_group = _my_group(dist, self._axis_lists("pipe"), self.global_rank)
        self.slice_proc_group, self.slice_group = _my_group(dist, self._axis_lists("model"), self.global_rank)
        self.ds_model_rank = self.ds_model_ranks.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_ranks)

    def _axis_lists(self, axis: str) -> list[list[int]]:
        lists = self._topo.get_axis_comm_lists(axis)
        return lists or [[r] for r in range(self.world_size)]  # an absent axis: every rank alone

    def get_stage_id(self) -> int:
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """The global rank of ``stage_id`` in this rank's replica (other axes as given, else mine)."""
        me = self._topo.get_coord(self.global_rank)
        return self._topo.get_rank(**me._replace(pipe=stage_id, **kwargs)._asdict())

    def topology(self) -> ProcessTopology:
        return self._topo

    # Megatron's mpu methods, as DeepSpeed's grid answers them
    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        return self.dp_proc_group

    def get_model_parallel_rank(self) -> int:
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "model", 0)

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group


def _default_topology(world_size: int) -> ProcessTopology:
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


def _my_group(dist: Any, lists: list[list[int]], rank: int) -> tuple[Any, list[int]]:
    """Create a group for every list (all ranks, same order); return mine and its ranks.

    A list that is the whole world is the default group itself: no second communicator.
    """
    mine: tuple[Any, list[int]] = (None, [rank])
    world = list(range(dist.get_world_size()))
    for ranks in lists:
        group = dist.group.WORLD if ranks == world else dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine
