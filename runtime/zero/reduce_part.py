"""``ReducePart``: the param groups of a ZeRO strategy that reduce and shard over one process
group (``strategy.py`` composes one per reduce group), and the sum of their gradient norm over it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from dslaunch.runtime.zero.exchange import GradientExchange
from dslaunch.runtime.zero.gradients import FullGradients
from dslaunch.runtime.zero.placement import sum_over_ranks
from dslaunch.runtime.zero.sharded_gradients import ShardedGradients
from dslaunch.runtime.zero.specs import CommSettings, GroupSpec, ReduceGroup

if TYPE_CHECKING:
    from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["ReducePart"]


class ReducePart:
    """The param groups of a strategy that reduce and shard over one process group: their
    placement, gradient path and exchange (a dense model has one; expert parameters add one per
    expert group).

    collective: construct on all ranks of the group.
    """

    def __init__(self, strategy: type[ZeroStrategy], specs: list[GroupSpec], indices: list[int],
                 comm: CommSettings, group: ReduceGroup, exchange: GradientExchange):
        self.indices, self.pg, self.exchange = indices, group.process_group, exchange
        self.world_size = dist.get_world_size(self.pg) if dist.is_initialized() else 1
        self.rank = dist.get_rank(self.pg) if dist.is_initialized() else 0
        spread, self.norm_owner = group.spread_group, group.norm_owner
        self.spread_sum = sum_over_ranks(dist.get_world_size(spread), spread) if spread is not None else None
        self.placement = strategy.placement_type(specs, comm, self.world_size, self.rank, self.pg)
        gradients_type = FullGradients if exchange.needs_local_gradients else strategy.gradients_type
        if comm.layout_invariant and strategy.placement_type.partitioned:
            # stage 1 too: its sum at the boundary would put each rank's micro steps in one
            # subtree, which another world size cannot form; stage 2's reduction per micro step can
            gradients_type = ShardedGradients
        self.gradients = gradients_type(self.placement.groups, comm, self.world_size, exchange)
        # Only the gradient path decides: stage 1 keeps (and lets hooks, the pipeline's tied-weight
        # sum and ``safe_get_full_grad`` read) the whole reduced gradient, though it updates its range.
        exchange.bind([g.layout for g in self.placement.groups], self.gradients.local_gradient,
                      owned_only=self.gradients.owned_only)

    def sum_norm(self, sq: torch.Tensor) -> None:
        """Sum a squared norm of these groups' gradient shards, in place, over the ranks sharing
        their state and then over those holding their other parameters (expert groups: the other
        experts).

        collective: all ranks of the group (and of its spread group)."""
        for reduce in (self.placement.norm_all_reduce, self.spread_sum):
            if reduce is not None:
                reduce(sq)
