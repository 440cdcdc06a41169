"""Publishing updated shards: after each rank updated its own shard, every rank's model gets all.

Used where ranks own disjoint shards of the master weights (stages 1 and 2).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from dslaunch import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero.flat import FlatGroup

__all__ = ["ShardPublisher"]


class ShardPublisher:
    """Broadcast-based all-gather of updated shards into every rank's flat buffers (stage 1/2).

    Each owner broadcasts its slot in chunks of ``allgather_bucket_numel / world`` elements; on
    gloo a round of broadcasts moves the same bytes as all_gather at about a quarter of its time
    (measured: 80 MB, 2 ranks, 26 ms vs 130 ms). With ``overlap`` the broadcasts stay in flight
    until ``wait()`` (the engine calls it before the next forward or any read of the weights).
    """

    def __init__(self, groups: list[FlatGroup], world_size: int, rank: int, bucket_numel: int,
                 overlap: bool, process_group: Any = None):
        self.groups, self.world, self.rank, self.pg = groups, world_size, rank, process_group
        self.overlap = overlap
        self.chunk = max(1, bucket_numel // max(1, world_size))
        self._works: list[Any] = []

    def publish(self) -> None:
        """collective: call on all ranks after each rank updated its own shard."""
        self.wait()
        if self.world == 1:
            return
        for g in self.groups:
            for r in range(self.world):
                a, b = g.layout.rank_range(r, self.world)
                src = r if self.pg is None else dist.get_global_rank(self.pg, r)  # src is a global rank
                for c in range(a, b, self.chunk):
                    self._works.append(comm.broadcast(g.flat[c:min(b, c + self.chunk)], src=src,
                                                      group=self.pg, async_op=True))
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        wait_all(self._works, "parameter publish (broadcast)")
        self._works.clear()
