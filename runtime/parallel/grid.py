"""The Megatron "mpu" of a topology: DeepSpeed's ``PipelineParallelGrid``, and the one-axis grid.

- ``PipelineParallelGrid(topology)``: the groups of a topology (``groups.ParallelGroups``) behind
  the mpu methods the engine reads (``get_data_parallel_group/rank/world_size``,
  ``get_model_parallel_*``: the model-parallel group is every rank of one data-parallel index,
  i.e. all pipeline stages and tensor slices of one replica), plus the pipe and slice groups.
- ``DataParallelGrid()``: the same methods for the one-axis case (every rank a data-parallel peer,
  the world group itself): no group is created, so a job without model parallelism pays nothing.
- ``sequence_grid(N)``: the grid of N sequence ranks per sample (the mpu
  ``UlyssesSPAttentionHF.register_with_transformers`` returns). The grid of the degrees a ds_config
  sets itself is ``from_config.grid_from_config``.

A grid with a sequence axis also answers the sequence questions DeepSpeed's
``parallel_state_sp`` answers: ``get_sequence_parallel_*`` (the ranks that split one sample) and
``get_sequence_data_parallel_*`` (data x sequence: where gradients average and ZeRO partitions).

Every rank must build a grid at the same point, with the same topology: group creation is
collective over the world (``groups.py``).
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import UsageError
from dslaunch.runtime.parallel.dims import ParallelDims
from dslaunch.runtime.parallel.groups import ParallelGroups
from dslaunch.runtime.parallel.topology import PipeDataParallelTopology, ProcessTopology, default_topology

__all__ = ["PipelineParallelGrid", "DataParallelGrid", "sequence_grid"]


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        raise UsageError("a process grid needs torch.distributed: call deepspeed.init_distributed() first")
    return dist


class DataParallelGrid:
    """The one-axis grid: every rank a data-parallel peer in the world group; no model parallelism.

    The engine reads this when no ``mpu`` and no pipeline topology is given. It creates no group
    but the expert groups a job with expert parameters asks for (``groups.experts``).
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.global_rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self._topo = PipeDataParallelTopology(1, self.world_size)
        # Only expert groups (``groups.experts``) are ever made from it: the data group is the world.
        self.groups = ParallelGroups(self._topo, self.global_rank)

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
        self._topo = topology if topology is not None else default_topology(self.world_size)
        if not self._is_grid_valid():
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
        self.groups = ParallelGroups(self._topo, self.global_rank)
        # DeepSpeed's grid creates these at construction, in this order. One replica's ranks (every
        # stage and slice of one data index): the overflow check and the gradient norm agree there.
        self.ds_model_proc_group, self.ds_model_ranks = self._role("replica")
        self.dp_proc_group, self.dp_group = self._role("loading")
        self.pp_proc_group, self.pp_group = self._role("pipe")
        self.slice_proc_group, self.slice_group = self._role("tensor")
        self.ds_model_rank = self.ds_model_ranks.index(self.global_rank)
        self.ds_model_world_size = len(self.ds_model_ranks)
        self.sequence_parallel_size = max(self._topo.get_dim("sequence"), 1)
        if self.sequence_parallel_size > 1:  # made here, in one order on every rank
            self.sp_proc_group, self.seq_dp_proc_group = self.groups.group("sequence"), self.groups.group("gradient_reduce")

    def _role(self, role: str) -> tuple[Any, list[int]]:
        return self.groups.group(role), self.groups.ranks(role)

    def _is_grid_valid(self) -> bool:
        """Whether the topology's axes multiply out to the world: every rank has one coordinate.
        (DeepSpeed's name; its tests call it.)"""
        return self._topo.world_size() == self.world_size

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

    # DeepSpeed's parallel_state_sp questions (1, 0 and no group without a sequence axis)
    def get_sequence_parallel_world_size(self) -> int:
        return self.sequence_parallel_size

    def get_sequence_parallel_rank(self) -> int:
        return getattr(self._topo.get_coord(self.global_rank), "sequence", 0)

    def get_sequence_parallel_group(self) -> Any:
        if self.sequence_parallel_size == 1:
            raise KeyError("No sequence parallel group found (this grid has no sequence axis)")
        return self.sp_proc_group

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.data_parallel_size * self.sequence_parallel_size

    def get_sequence_data_parallel_rank(self) -> int:
        return self.data_parallel_id * self.sequence_parallel_size + self.get_sequence_parallel_rank()

    def get_sequence_data_parallel_group(self) -> Any:
        return self.seq_dp_proc_group if self.sequence_parallel_size > 1 else self.dp_proc_group


def sequence_grid(sequence: int, key: str = "sequence_parallel_size") -> PipelineParallelGrid:
    """The grid of ``sequence`` ranks per sample and the data-parallel replicas the world leaves.

    collective: every rank.

    Raises:
        UsageError: ``sequence`` does not divide the world (naming ``key``).
    """
    dims = ParallelDims(sequence=sequence, keys=(("sequence", key),))
    world = _dist().get_world_size()
    problem = dims.problem(world)
    if problem:
        raise UsageError(problem)
    return PipelineParallelGrid(dims.topology(world))


