"""Ranks on named axes and the process groups of each role: one room for topology.

- ``topology.py``: ``ProcessTopology`` (ranks <-> coordinates, no groups) and DeepSpeed's pipeline
  topologies.
- ``dims.py``: ``ParallelDims``, the degree of each axis and the one check of their product
  against the world.
- ``groups.py``: the only module that creates process groups; ``ParallelGroups`` hands them out by
  role (loading, gradient_reduce, replica, loss, tensor, sequence, pipe, expert, expert_data).
- ``grid.py``: the Megatron "mpu" over a topology (``PipelineParallelGrid``, DeepSpeed's) and
  the one-axis ``DataParallelGrid``.
- ``mpu.py``: what any mpu answers for an axis (the tensor group's one lookup order) and which
  parameters count in the global gradient norm on this rank.
- ``from_config.py``: the degrees a ds_config sets itself, and the grid they make without an mpu.
- ``deepspeed_groups.py``: DeepSpeed's ``groups`` module (``deepspeed.utils.groups`` is it): this
  rank's groups from the last engine's grid, expert groups by ``ep_size_<N>`` name.
- ``tensor_experts.py``: expert groups beside an mpu with tensor slices (DeepSpeed's two layouts:
  experts over every rank of a stage, or over each tensor lane's data ranks).

DeepSpeed's import paths (``deepspeed.runtime.pipe.topology``, ``deepspeed.utils.groups``) answer
from here.
"""

from dslaunch.runtime.parallel.dims import ParallelDims
from dslaunch.runtime.parallel.grid import DataParallelGrid, PipelineParallelGrid
from dslaunch.runtime.parallel.groups import ROLES, ParallelGroups
from dslaunch.runtime.parallel.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["ParallelDims", "ParallelGroups", "ROLES", "ProcessTopology", "PipeDataParallelTopology",
           "PipeModelDataParallelTopology", "PipelineParallelGrid", "DataParallelGrid"]
