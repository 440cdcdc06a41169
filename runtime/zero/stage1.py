"""ZeRO stage 1: optimizer state and fp32 master weights partitioned across ranks.

Gradients are reduced exactly as in stage 0 (``FullGradients``: full flat buffer, bucketed
all-reduce at the boundary: on gloo an all-reduce beats reduce-scatter of the same buffer), but
each rank then updates only its own shard ``partition_range(numel, world, rank)`` with the
optimizer, and the updated shards are broadcast to every rank in chunks of
``allgather_bucket_size`` elements (``Sharded``, through ``ShardPublisher``; with ``overlap_param_gather``
the gather overlaps whatever runs before the next forward). Optimizer state and master weights
per rank: 1/N of stage 0.
"""

from __future__ import annotations

from dslaunch.runtime.zero.gradients import FullGradients
from dslaunch.runtime.zero.placement import Sharded
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage1"]


class Stage1(ZeroStrategy):
    """Stage 0's gradient path with a partitioned optimizer step and a parameter gather."""

    stage = 1
    placement_type = Sharded
    gradients_type = FullGradients
