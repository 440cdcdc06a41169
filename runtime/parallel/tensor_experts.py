"""Expert groups of a job with tensor slices (an mpu whose tensor axis has more than one rank):
DeepSpeed's two layouts, chosen per expert-parallel size by the first MoE layer that asks.

- Experts not tensor-sliced (``MoE(enable_expert_tensor_parallelism=False)``, the default):
  DeepSpeed ignores the tensor axis and splits each pipeline stage's ranks as if they were all data
  ranks (expert groups of ``N`` neighbouring ranks, which may be tensor peers). The slices of a
  replica then each run their share of the slots (``moe/tensor_slices.py``).
- Experts tensor-sliced (``enable_expert_tensor_parallelism=True``,
  ``groups._create_expert_data_and_model_parallel``): each tensor lane's data ranks split into
  experts, as DeepSpeed's ``_get_expert_parallel_ranks`` (world 16, tensor 2, experts 4: expert
  groups [0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]).

Both are named axes on a ``ParallelGroups`` (``pipe, data`` or ``pipe, data, model``), so the
expert and expert-data groups come from the one module that creates groups. The mpu's own tensor
and data groups must be where DeepSpeed's rank arithmetic assumes them (tensor slices neighbours,
data ranks every ``tp``-th): checked, one line if not.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.parallel.groups import ParallelGroups
from dslaunch.runtime.parallel.mpu import bwc_pipeline_parallel_world_size, tensor_axis
from dslaunch.runtime.parallel.topology import ProcessTopology

__all__ = ["TensorExperts", "expert_parallel_ranks"]


def _sliced_topology(world: int, tensor: int, pipe: int) -> ProcessTopology:
    from dslaunch.errors import UsageError

    if tensor < 1 or pipe < 1 or world % (tensor * pipe):
        raise UsageError(f"expert groups: tensor parallel size {tensor} x pipeline size {pipe} must divide the "
                         f"world size {world}")
    return ProcessTopology(["pipe", "data", "model"], [pipe, world // (tensor * pipe), tensor])


def expert_parallel_ranks(world_size: int, tensor_parallel_size_: int, expert_parallel_size_: int,
                          pipeline_parallel_size_: int = 1,
                          use_data_before_expert_parallel_: bool = False) -> tuple[list[list[int]], list[list[int]]]:
    """DeepSpeed's ``groups._get_expert_parallel_ranks``: the expert groups and the expert-data groups
    of tensor-sliced experts, lane by lane (pure arithmetic).

    Raises:
        UsageError: the sizes do not divide the world, or the expert size the data size.
    """
    topology = _sliced_topology(world_size, tensor_parallel_size_, pipeline_parallel_size_)
    split = ParallelGroups(topology, 0).experts(expert_parallel_size_, use_data_before_expert_parallel_)

    def by_lane(role: str) -> list[list[int]]:  # DeepSpeed lists lane 0's groups first
        return sorted(split.lists(role), key=lambda ranks: (ranks[0] % tensor_parallel_size_, ranks[0]))

    return by_lane("expert"), by_lane("expert_data")


class TensorExperts:
    """The expert splits of a job whose ``mpu`` has tensor slices: ``experts(size, ...)`` and
    ``expert_sizes()`` as ``ParallelGroups`` has them, each size in the layout its first caller
    chose (``sliced``).

    Raises:
        UsageError: the mpu's tensor or data group is not where DeepSpeed's layout puts it.
    """

    def __init__(self, mpu: Any, world: int, rank: int):
        self.mpu = mpu
        self.tensor_size = tensor_axis(mpu, "world_size")
        pipe = bwc_pipeline_parallel_world_size(mpu)
        sliced = _sliced_topology(world, self.tensor_size, pipe)
        self._check(sliced, rank)
        self._homes = {False: ParallelGroups(ProcessTopology(["pipe", "data"], [pipe, world // pipe]), rank),
                       True: ParallelGroups(sliced, rank)}
        self._sliced: dict[int, bool] = {}

    def _check(self, topology: ProcessTopology, rank: int) -> None:
        import torch.distributed as dist

        from dslaunch.errors import UsageError

        home = ParallelGroups(topology, rank)
        for role, group in (("tensor", tensor_axis(self.mpu, "group")), ("loading", self.mpu.get_data_parallel_group())):
            have = sorted(dist.get_process_group_ranks(group)) if group is not None else None
            if have is not None and have != home.ranks(role):
                raise UsageError(f"MoE with tensor parallelism: the mpu's {role if role == 'tensor' else 'data'} "
                                 f"group of rank {rank} is {have}, DeepSpeed's expert layout needs "
                                 f"{home.ranks(role)} (tensor slices neighbouring ranks, data ranks every "
                                 f"{self.tensor_size}-th)")

    def experts(self, size: int, data_before_expert: bool = False, sliced: bool | None = None) -> ParallelGroups:
        """The split for ``size`` expert ranks; ``sliced`` (tensor-sliced experts) counts when the
        size is first asked for (None then: not sliced), as DeepSpeed makes a name once."""
        if size not in self._sliced:
            self._sliced[size] = bool(sliced)
        return self._homes[self._sliced[size]].experts(size, data_before_expert)

    def expert_sizes(self) -> list[int]:
        return list(self._sliced)

    def sliced(self, size: int) -> bool:
        """Whether the ``size`` split is the tensor-sliced layout."""
        return self._sliced.get(size, False)

    @property
    def expert_tensor_size(self) -> int:
        """DeepSpeed's ``expert_tensor_parallel_world_size``: the tensor size once any split is
        sliced, else 1."""
        return self.tensor_size if any(self._sliced.values()) else 1
