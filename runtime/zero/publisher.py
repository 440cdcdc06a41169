"""Publishing updated shards: after each rank updated its own shard, every rank's model gets all.

Used where ranks own disjoint shards of the master weights (stages 1 and 2).

With ``overlap`` the gathers stay in flight into the next forward, as Megatron's distributed
optimizer does with ``overlap_param_gather``: ``gate`` puts a forward pre-hook on every module
that waits only for the broadcasts up to the end of the parameters that module uses, so the
first layers compute while the last ones are still arriving. The broadcasts complete in the order
they were issued (flat order, usually forward order), so waiting for one waits for all before it.
Which parameters a module uses follows stage 3's rule (``fetcher.module_params``): its own, those
attached with ``register_external_parameter``, and a leaf module's whole subtree.

Where every rank of the group is on this host (``shm.py``) the shards go through shared memory
instead, at once (no overlap: on the CPU the copies are the work, on the same cores).
"""

from __future__ import annotations

import bisect
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero.fetcher import module_params
from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.shm import SharedMemoryCollectives, SharedTensors

__all__ = ["ShardPublisher"]


class ShardPublisher:
    """Broadcast-based all-gather of updated shards into every rank's flat buffers (stage 1/2).

    Each owner broadcasts its slot in chunks of ``allgather_bucket_numel / world`` elements; on
    gloo a round of broadcasts moves the same bytes as all_gather at about a quarter of its time
    (measured: 80 MB, 2 ranks, 26 ms vs 130 ms). With ``overlap`` the broadcasts stay in flight
    until ``wait()`` (the engine calls it before anything reads the weights outside a forward) or,
    in a forward, until a gated module needs them (``gate``).
    """

    def __init__(self, groups: list[FlatGroup], world_size: int, rank: int, bucket_numel: int,
                 overlap: bool, process_group: Any = None, shm: SharedMemoryCollectives | None = None,
                 shared: list[SharedTensors] | None = None):
        self.groups, self.world, self.rank, self.pg, self.shm = groups, world_size, rank, process_group, shm
        # each group's flat weights as a shared buffer (peers copy in place), where they are one
        self._shared = {id(g): next((s for s in shared or () if s.offset(g.flat) == 0), None) for g in groups}
        self.overlap = overlap
        self.chunk = max(1, bucket_numel // max(1, world_size))
        self._works: list[Any] = []
        self._ends: list[tuple[int, int]] = []  # (group, end element) of each work, ascending
        self._done = 0  # works before this index are complete
        self._where: dict[int, tuple[int, int]] = {}  # param id -> (group, end element) in the flat

    def publish(self) -> None:
        """collective: call on all ranks after each rank updated its own shard."""
        self.wait()
        if self.world == 1:
            return
        if self.shm is not None and self.shm.applies(*(g.flat for g in self.groups)):
            for g in self.groups:
                ranges = [g.layout.rank_range(r, self.world) for r in range(self.world)]
                if self._shared[id(g)] is not None:
                    self._shared[id(g)].gather(ranges, "parameter publish (shared memory)")
                else:
                    self.shm.all_gather([g.flat[a:b] for a, b in ranges], "parameter publish (shared memory)")
            return
        for gi, g in enumerate(self.groups):
            for r in range(self.world):
                a, b = g.layout.rank_range(r, self.world)
                src = r if self.pg is None else dist.get_global_rank(self.pg, r)  # src is a global rank
                for c in range(a, b, self.chunk):
                    end = min(b, c + self.chunk)
                    self._works.append(comm.broadcast(g.flat[c:end], src=src, group=self.pg, async_op=True))
                    self._ends.append((gi, end))
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        wait_all(self._works[self._done:], "parameter publish (broadcast)")
        self._works.clear()
        self._ends.clear()
        self._done = 0

    def wait_until(self, need: tuple[int, int]) -> None:
        """Wait for the broadcasts covering the flat elements up to ``need`` = (group, end)."""
        upto = bisect.bisect_left(self._ends, need) + 1
        if upto > self._done:
            wait_all(self._works[self._done:upto], "parameter publish (broadcast)")
            self._done = min(upto, len(self._works))

    def gate(self, module: torch.nn.Module) -> list[Any]:
        """Hook every submodule of ``module`` to wait, before its forward, for the broadcasts of
        the parameters it uses (only with ``overlap``). Returns the hook handles."""
        if not self.overlap or self.world == 1:
            return []
        self._where = {id(p): (gi, g.layout.param_range(pi)[1]) for gi, g in enumerate(self.groups)
                       for pi, p in enumerate(g.params)}
        return [m.register_forward_pre_hook(self._before) for m in module.modules()]

    def _before(self, m: torch.nn.Module, args: Any) -> None:
        if self._works:  # read at each call: external parameters may be registered after the engine
            ends = [self._where[id(p)] for p in module_params(m) if id(p) in self._where]
            if ends:
                self.wait_until(max(ends))
