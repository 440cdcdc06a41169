"""ZeRO stage 2: gradients reduced into the owning rank's shard as backward produces them.

No full gradient buffer is kept (``ShardedGradients``): each gradient is copied into its bucket of
``reduce_bucket_size`` elements and freed, every complete bucket is all-reduced (on gloo faster
than reduce-scatter) and each rank keeps the part inside its own range, in an fp32 gradient shard.
Every micro step communicates (the shard is all a rank keeps), as in DeepSpeed, so ``no_sync()`` is
refused. The optimizer step and the publish of updated shards are stage 1's (``Sharded``).
Optimizer state, master weights and gradients per rank: 1/N of stage 0.
"""

from __future__ import annotations

from dslaunch.runtime.zero.placement import Sharded
from dslaunch.runtime.zero.sharded_gradients import ShardedGradients
from dslaunch.runtime.zero.strategy import ZeroStrategy

__all__ = ["Stage2"]


class Stage2(ZeroStrategy):
    """Partitioned optimizer state and gradients; bucketed reduction from backward hooks."""

    stage = 2
    placement_type = Sharded
    gradients_type = ShardedGradients
