"""Where the fp32 master weights and the optimizer state live: on every rank, or sharded.

The one place that knows what partitioning the optimizer state means for a step:

- ``Replicated`` (stage 0): every rank holds the whole of each group and applies the same update;
  norms are local, nothing needs publishing.
- ``Sharded`` (stages 1 and 2): rank r owns ``partition_range(numel, world, r)`` of each group and
  updates only that; norms are summed over the ranks and the updated shards are published to
  every rank's model (``ShardPublisher``).

Checkpoints read only ``partitioned``: whether every rank's state differs (each rank writes its
own file) or rank 0's is everyone's.

Stage 3's placement, which also shards the module's parameters, is ``partitioned.Partitioned``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import waiting
from dslaunch.runtime.zero.flat import FlatGroup
from dslaunch.runtime.zero.partition import GroupLayout
from dslaunch.runtime.zero.publisher import ShardPublisher
from dslaunch.runtime.zero.shm import SharedMemoryCollectives, SharedTensors
from dslaunch.runtime.zero.specs import CommSettings, GroupSpec, largest_piece

__all__ = ["Placement", "Replicated", "Sharded", "sum_over_ranks", "gather_over_ranks"]


def sum_over_ranks(world_size: int, process_group: Any) -> Callable[[torch.Tensor], None] | None:
    """In-place sum over the ranks (for norms of disjoint shards); None in a world of one."""
    if world_size == 1:
        return None

    def reduce(t: torch.Tensor) -> None:
        # gloo/nccl sum; inf/nan propagate to all ranks. NCCL reduces only device tensors (an
        # offloaded shard's norm is on the host): through a device copy there.
        with waiting("all_reduce of the gradient norm"):
            if dist.get_backend(process_group) == "nccl" and t.device.type == "cpu":
                tmp = t.to(torch.device("cuda", torch.cuda.current_device()))
                comm.all_reduce(tmp, group=process_group)
                t.copy_(tmp)
            else:
                comm.all_reduce(t, group=process_group)
    return reduce


def gather_over_ranks(world_size: int, process_group: Any
                      ) -> Callable[[torch.Tensor, GroupLayout], torch.Tensor] | None:
    """``gather(shard, layout)``: a group's whole flat vector (``layout.numel`` elements) from each
    rank's [start, end) shard (collective); None in a world of one."""
    if world_size == 1:
        return None

    def gather(shard: torch.Tensor, layout: GroupLayout) -> torch.Tensor:
        slot = layout.padded // world_size  # every rank sends a full slot; the last ones pad
        mine = shard if shard.numel() == slot else torch.cat([shard, shard.new_zeros(slot - shard.numel())])
        out = shard.new_empty(layout.padded)
        with waiting("all_gather of a Muon group"):
            comm.all_gather_into_tensor(out, mine.contiguous(), group=process_group)
        return out[:layout.numel]
    return gather


class Placement:
    """Owns the ``FlatGroup`` of every param group, laid out for this placement.

    Class attributes:
        partitioned: ranks own disjoint shards of the master weights and optimizer state.
        always_norm: compute the global gradient norm at every step, as DeepSpeed's ZeRO-1/2
            optimizers do (``get_global_grad_norm``); otherwise only when clipping, the overflow
            check or a 16-bit model needs it.

    collective: construct on all ranks of the group.
    """

    partitioned: ClassVar[bool] = False
    always_norm: ClassVar[bool] = False

    def __init__(self, specs: list[GroupSpec], comm: CommSettings, world_size: int, rank: int,
                 process_group: Any = None):
        self.world_size, self.rank, self.pg = world_size, rank, process_group
        self.groups = self._build_groups(specs, comm)
        self.publisher: ShardPublisher | None = None

    def _build_groups(self, specs: list[GroupSpec], comm: CommSettings) -> list[Any]:
        return [FlatGroup(g.params, g.names, dict(g.hparams), self.world_size, self.rank, self.partitioned,
                          comm.offload_optimizer, comm.pin_memory, self._alloc) for g in specs]

    def _alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A group's flat weights (``FlatGroup``'s ``alloc``)."""
        return torch.empty(numel, dtype=dtype, device=device)

    @property
    def norm_all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        """In-place sum over the ranks for quantities each rank has a part of; None: all local."""
        return None

    def publish(self) -> None:
        """Make every rank's updated shard visible in every rank's model (collective)."""

    def wait(self) -> None:
        """Wait for an in-flight publish: call before anything reads the module weights."""


class Replicated(Placement):
    """Every rank holds the whole master and optimizer state (stage 0)."""


class Sharded(Placement):
    """Rank r holds ``partition_range(numel, world, r)`` of each group's master and optimizer
    state, and publishes its updated shard after each step (stages 1 and 2)."""

    partitioned = True
    always_norm = True

    def __init__(self, specs: list[GroupSpec], comm: CommSettings, world_size: int, rank: int,
                 process_group: Any = None):
        # same-host ranks: each rank's flat weights in shared memory, published by copying in place;
        # where one has no room there, through slots of one rank's shard at most
        self.shm = (SharedMemoryCollectives.build(process_group, comm.shared_memory,
                                                  largest_piece(specs, world_size, whole=False))
                    if world_size > 1 else None)
        self.shared: list[SharedTensors] = []
        super().__init__(specs, comm, world_size, rank, process_group)
        self.publisher = ShardPublisher(self.groups, world_size, rank, comm.allgather_bucket_numel,
                                        comm.overlap_param_gather, process_group, self.shm, self.shared)

    def _alloc(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shared = SharedTensors.make(self.shm, numel, dtype) if self.shm is not None and device.type == "cpu" else None
        if shared is None:  # elsewhere, or no room in /dev/shm: private, published through the slots
            return torch.empty(numel, dtype=dtype, device=device)
        self.shared.append(shared)
        return shared.mine

    @property
    def norm_all_reduce(self) -> Callable[[torch.Tensor], None] | None:
        return sum_over_ranks(self.world_size, self.pg)

    def publish(self) -> None:
        self.publisher.publish()

    def wait(self) -> None:
        self.publisher.wait()
