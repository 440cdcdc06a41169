"""The parallel degrees a ds_config sets itself, and the grid they make when no mpu is given.

DeepSpeed reads two model-parallel degrees from the config (no mpu needed):
``tensor_parallel.autotp_size`` (AutoTP training) and ``sequence_parallel_size`` (Ulysses). Both
shrink the data-parallel world the batch sizes are resolved for, and both need a grid with their
axis. This module is the one place that turns them into ``ParallelDims`` and a grid.

Torch-free at import (the grid imports torch.distributed when built).
"""

from __future__ import annotations

from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.parallel.dims import ParallelDims

__all__ = ["config_dims", "data_world_size", "grid_from_config"]


def config_dims(tensor_parallel: Any = None, sequence: int = 1) -> ParallelDims:
    """The degrees the config sets (``tensor_parallel``: a ``TensorParallelConfig`` or None;
    ``sequence``: ``sequence_parallel_size``), with the keys that set them for messages."""
    tensor = tensor_parallel.size if tensor_parallel is not None else 1
    keys = (*((("tensor", "tensor_parallel.autotp_size"),) if tensor > 1 else ()),
            *((("sequence", "sequence_parallel_size"),) if sequence != 1 else ()))
    return ParallelDims(tensor=tensor, sequence=sequence, keys=keys)


def data_world_size(dims: ParallelDims, world: int) -> int:
    """The data-parallel degree ``dims`` leave of ``world`` ranks.

    Raises:
        ConfigError: the degrees do not divide the world (one line naming the keys).
    """
    problem = dims.problem(world)
    if problem is not None:
        keys = dict(dims.keys)
        raise ConfigError(problem, key=keys["sequence"] if list(keys) == ["sequence"] else None)
    return dims.data(world)


def grid_from_config(config: Any) -> Any:
    """The grid (mpu) of a job whose config sets model-parallel degrees and passes no mpu: None
    when it sets none, else a ``PipelineParallelGrid`` over the topology of its degrees (the
    ``model`` axis for the tensor slices, ``sequence`` for Ulysses: the N ranks of a sample
    neighbours, DeepSpeed's ``parallel_state_sp`` order).

    collective: every rank of the world (it creates process groups).

    Raises:
        ConfigError: the degrees do not divide the world.
    """
    import torch.distributed as dist

    from dslaunch.runtime.parallel.grid import PipelineParallelGrid

    dims = config_dims(config.tensor_parallel, config.sequence_parallel_size)
    if dims.replica_size == 1:
        return None
    world = dist.get_world_size()
    data_world_size(dims, world)
    return PipelineParallelGrid(dims.topology(world))
