"""Process groups: the one module that creates them, and the groups of a topology by role.

Creating a group is collective over the world: every rank creates every group, in the same order,
even those it is not in. dslaunch creates groups only here (a test walks the sources for other
``new_group`` calls), so that order has one author.

Roles name what a group is for, not an axis; ``ParallelGroups.group(role)``:

==================  ===========================================================================
``loading``         the ranks that read distinct samples (the data axis)
``gradient_reduce`` the ranks that average a (dense) parameter's gradient: data x sequence
``loss``            the ranks over which a loss is averaged: data x sequence
``replica``         the ranks that together hold one copy of the model: every axis but data and
                    sequence (pipeline stages, tensor slices); the gradient norm, the overflow
                    skip and the clip factor are agreed over it (after the data axis)
``tensor``          the tensor slices of one layer (the topology's ``model`` axis, DeepSpeed's name)
``sequence``        the ranks that split one sample's sequence (Ulysses)
``pipe``            the stages of one replica
``expert``          the data ranks that hold different experts (``expert`` > 1 splits the data
                    axis into ``expert_data`` x ``expert``, expert fastest, as DeepSpeed's groups)
``expert_data``     the data ranks that hold the same experts (where expert gradients reduce)
==================  ===========================================================================

A group is created on the first ask for its role (collective: every rank asks, in the same order)
and kept; a role that spans the world is the world group itself, not a second communicator.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from dslaunch.runtime.parallel.topology import ProcessTopology

__all__ = ["ROLES", "ParallelGroups", "new_groups", "dedicated_world_group", "ep_size_of"]

_DATA = ("data", "expert_data", "expert")
ROLE_AXES: dict[str, tuple[str, ...]] = {
    "loading": _DATA, "gradient_reduce": (*_DATA, "sequence"), "loss": (*_DATA, "sequence"),
    "tensor": ("model", "tensor"), "sequence": ("sequence",), "pipe": ("pipe",),
    "expert": ("expert",), "expert_data": ("expert_data",),
}
"""The topology axes each role varies over (``replica``: every axis not in ``loss``)."""
ROLES = (*ROLE_AXES, "replica")


def ep_size_of(group_name: Any) -> int | None:
    """The expert-parallel size an expert group's name carries (DeepSpeed's ``ep_size_<N>``, N >= 1);
    None for any other name."""
    prefix, _, size = str(group_name).rpartition("_")
    return int(size) if prefix == "ep_size" and size.isdigit() and int(size) >= 1 else None


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        from dslaunch.errors import UsageError

        raise UsageError("process groups need torch.distributed: call deepspeed.init_distributed() first")
    return dist


def new_groups(lists: Sequence[Sequence[int]], rank: int | None = None) -> tuple[Any, list[int]]:
    """Create a group for every rank list (in order) and return mine and its ranks.

    A list that is the whole world is the world group itself; a rank in no list gets
    ``(None, [rank])``. A list of one rank gets a group too (DeepSpeed's grid has them: a size-1
    group answers collectives as a no-op, where None would mean the world).

    collective: call on every rank of the world with the same lists.
    """
    dist = _dist()
    rank = dist.get_rank() if rank is None else rank
    world = list(range(dist.get_world_size()))
    mine: tuple[Any, list[int]] = (None, [rank])
    for ranks in map(list, lists):
        group = dist.group.WORLD if ranks == world else dist.new_group(ranks=ranks)
        if rank in ranks:
            mine = (group, ranks)
    return mine


def dedicated_world_group(backend: str, timeout_s: float) -> Any:
    """A second communicator over the whole world (a background checkpoint save's collectives must
    not interleave with the training loop's on the default group). collective: every rank."""
    return _dist().new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))


class ParallelGroups:
    """This rank's process groups of ``topology``, by role, each created once on first ask.

    Args:
        topology: the ranks on named axes (``pipe``, ``data``, ``sequence``, ``model``; others
            count as model parallel, i.e. in ``replica``).
        rank: this rank's global rank.
        expert: expert-parallel degree: splits the data axis into ``expert_data`` x ``expert``.

    collective: ``group(role)`` the first time for each role, on every rank, in the same order.
    """

    def __init__(self, topology: ProcessTopology, rank: int, expert: int = 1, data_before_expert: bool = False):
        self.base_topology = topology
        self.topology = _split_data(topology, expert, data_before_expert) if expert > 1 else topology
        self.rank = rank
        self._made: dict[str, Any] = {}
        self._experts: dict[int, ParallelGroups] = {}

    def experts(self, size: int, data_before_expert: bool = False) -> ParallelGroups:
        """The groups of this topology with the data axis split into ``size`` expert ranks (the
        ``expert`` and ``expert_data`` roles; size 1 too), one split per size, kept: DeepSpeed's
        groups named ``ep_size_<size>``. ``data_before_expert`` (DeepSpeed's
        ``use_data_before_expert_parallel_``) counts only when a size is first asked for, as
        DeepSpeed creates a name once.

        Raises:
            UsageError: ``size`` does not divide the data axis (one line naming both).
        """
        if size not in self._experts:
            split = ParallelGroups(self.base_topology, self.rank)
            split.topology = _split_data(self.base_topology, size, data_before_expert)
            self._experts[size] = split
        return self._experts[size]

    def expert_sizes(self) -> list[int]:
        """The expert-parallel sizes split so far, in the order first asked for."""
        return list(self._experts)

    def axes(self, role: str) -> list[str]:
        """The topology axes ``role`` varies over."""
        if role == "replica":
            return [a for a in self.topology.axes if a not in ROLE_AXES["loss"]]
        if role not in ROLE_AXES:
            raise KeyError(f"no process group role {role!r}; roles: {', '.join(ROLES)}")
        return [a for a in self.topology.axes if a in ROLE_AXES[role]]

    def lists(self, role: str) -> list[list[int]]:
        """Every rank list of ``role`` (one group each), in creation order."""
        return self.topology.comm_lists(self.axes(role))

    def ranks(self, role: str) -> list[int]:
        """The global ranks of my group of ``role`` (no group is created)."""
        return next(r for r in self.lists(role) if self.rank in r)

    def size(self, role: str) -> int:
        return len(self.ranks(role))

    def rank_in(self, role: str) -> int:
        """My index in my group of ``role``."""
        return self.ranks(role).index(self.rank)

    def group(self, role: str) -> Any:
        """My process group of ``role``.

        collective: on first call for ``role``.
        """
        if role not in self._made:
            self._made[role] = new_groups(self.lists(role), self.rank)[0]
        return self._made[role]


def _split_data(topology: ProcessTopology, expert: int, data_before_expert: bool) -> ProcessTopology:
    """``topology`` with its data axis cut into expert x expert-data ranks: expert fastest (DeepSpeed's
    E + D default: the ranks holding different experts are neighbours), or expert-data fastest
    (D + E: the ranks holding the same experts are).

    Raises:
        UsageError: ``expert`` does not divide the data axis.
    """
    data = topology.get_dim("data")
    if expert < 1 or data % expert:
        from dslaunch.errors import UsageError

        raise UsageError(f"expert parallel size {expert} must divide the data-parallel size {data}")
    if data_before_expert:
        return topology.split("data", "expert", "expert_data", data // expert)
    return topology.split("data", "expert_data", "expert", expert)
