"""The gradient-communication seam: how a bucket of gradients is exchanged across the data-parallel group.

The bucket reducer (``reducer.py``) never calls a collective itself: it hands each bucket to the
strategy's ``GradientExchange``, picked once when the engine is built (``build_exchange``):

- ``FlatAllReduce``: one all-reduce (sum) over the data-parallel group; the default.
- ``TreeAllReduce``: the same sum in one fixed pairwise tree over the group's ranks, under
  ``layout_invariant`` (gloo's ring adds the ranks in a chain whose start depends on the element).
- ``HierarchicalAllReduce``: when several ranks share a node, reduce to one leader per node, all-reduce
  between the leaders, broadcast within the node; chosen from the topology (hosts x local ranks)
  where it moves fewer bytes across nodes.
- ``SharedMemoryExchange``: every rank of the group on this host, CPU tensors (``shm.py``): the same
  sum through ``/dev/shm`` instead of loopback TCP; a reduce-scatter into this rank's range where the
  gradient path keeps only that range (stages 2/3, ``owned_only``).
- ``CompressedExchange``: for the 1-bit optimizers (``optim.onebit``). During their warm-up it is the
  flat all-reduce; afterwards the gradients stay local (the optimizer exchanges its momentum,
  sign-compressed with error feedback, through ``optim.compression``) and the exchange owns that
  error-feedback state, which every rank checkpoints (``state_dict``).

Every collective goes through ``dslaunch.comm``, so the comms logger counts this traffic too.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import CheckpointError, ConfigError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.inference.shm_allreduce import segment_directory
from dslaunch.runtime.parallel.groups import new_groups
from dslaunch.runtime.zero.partition import GroupLayout
from dslaunch.runtime.zero.shm import SLOT_BYTES, SharedMemoryCollectives, SharedTensors
from dslaunch.runtime.zero.specs import GroupSpec, largest_piece
from dslaunch.utils.logging import log_dist

__all__ = ["GradientExchange", "FlatAllReduce", "TreeAllReduce", "HierarchicalAllReduce", "CompressedExchange",
           "SharedMemoryExchange", "NodeLayout", "build_exchange"]


class GradientExchange:
    """Sums a gradient buffer over the data-parallel group, in place. Stateless by default.

    collective: ``all_reduce`` on all ranks of the group, same buffers, same order.
    """

    name = "flat"
    needs_local_gradients = False  # the optimizer reads each rank's full unreduced gradient
    deferred = False  # reduce_bucket's handle does the work in wait(): the reducer holds buckets to flush

    def __init__(self, process_group: Any = None):
        self.pg = process_group
        self.layouts: list[GroupLayout] = []  # per param group: its params and this rank's [start, end)
        self.local_gradient: Callable[[int], torch.Tensor] | None = None
        self.owned_only = False  # the gradient path reads only this rank's range of a reduced bucket

    def bind(self, layouts: list[GroupLayout], local_gradient: Callable[[int], torch.Tensor],
             owned_only: bool = False) -> None:
        """Called by the strategy once built: each param group's layout on this rank, a function
        returning group i's whole local gradient (where the strategy keeps it), and whether only
        this rank's range [start, end) of each reduced bucket is read."""
        self.layouts, self.local_gradient, self.owned_only = layouts, local_gradient, owned_only

    def all_reduce(self, buf: torch.Tensor) -> Any:
        """Start summing ``buf`` over the group; returns a handle to wait on (None: done)."""
        return comm.all_reduce(buf, group=self.pg, async_op=True)

    def gradient_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A whole-gradient buffer for a gradient path to keep (stage 0/1), which this exchange may
        read in place. collective: all ranks, in the same order."""
        return torch.empty(numel, dtype=dtype, device=device)

    def reduce_bucket(self, buf: torch.Tensor, group: int, begin: int) -> Any:
        """Sum bucket ``buf`` (elements [begin, ...) of param group ``group``'s flat vector); the
        default sums all of it (``all_reduce``). A reduce-scatter exchange (ZeRO++'s qgZ) may leave
        only this rank's owned range summed."""
        return self.all_reduce(buf)

    def summed_ranks(self, world_size: int) -> int:
        """How many ranks' gradients the reduced buffers hold (the mean divides by it)."""
        return world_size

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name}

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        return None


class FlatAllReduce(GradientExchange):
    """One all-reduce over the whole data-parallel group."""


class TreeAllReduce(GradientExchange):
    """Recursive doubling: in round ``k`` group rank ``i`` swaps its buffer with rank ``i ^ 2**k``
    and both add (``a + b`` equals ``b + a`` bit for bit). The result is the pairwise tree over the
    ranks in group order, ``((r0 + r1) + (r2 + r3)) + ...``: the tree a smaller world completes by
    accumulating micro steps (``sharded_gradients.ShardedGradients``) and the expert blocks
    (``moe.layout_invariant``) start, so the sum is the same at any layout. Synchronous; moves
    ``log2(W)`` buffers per rank where a ring moves ``2 (W - 1) / W``.

    Raises:
        ConfigError: the group's size is not a power of two (no such tree at every layout).
    """

    name = "tree"
    # Blocking point-to-point rounds inside backward would deadlock against the MoE all-to-alls
    # wherever ranks reach their buckets in another order (a rank whose experts got no token):
    # the rounds run at the flush, in the reducer's fixed bucket order.
    deferred = True

    def __init__(self, process_group: Any = None):
        super().__init__(process_group)
        self.ranks = comm.get_all_ranks_from_group(process_group) if dist.is_initialized() else [0]
        self.me = dist.get_rank(process_group) if dist.is_initialized() else 0
        if len(self.ranks) & (len(self.ranks) - 1):
            raise ConfigError(f"true needs power-of-two reduce groups; this one has {len(self.ranks)} ranks "
                              f"({self.ranks}): use 1, 2, 4, 8... data and expert-data ranks",
                              key="layout_invariant.enabled")

    def all_reduce(self, buf: torch.Tensor) -> _Rounds:
        return _Rounds(self, buf)

    def run(self, buf: torch.Tensor) -> None:
        """The rounds, now (collective on the group, point to point)."""
        other = torch.empty_like(buf)
        step = 1
        while step < len(self.ranks):
            peer = self.ranks[self.me ^ step]
            wait_all((comm.isend(buf, peer, group=self.pg), comm.irecv(other, peer, group=self.pg)),
                     "all_reduce of gradients (fixed tree)")
            buf.add_(other)
            step *= 2


class _Rounds:
    """A ``TreeAllReduce`` of one buffer, run by ``wait``."""

    def __init__(self, tree: TreeAllReduce, buf: torch.Tensor):
        self.tree, self.buf, self.ran = tree, buf, False

    def is_completed(self) -> bool:
        return self.ran

    def wait(self) -> None:
        if not self.ran:
            self.tree.run(self.buf)
            self.ran = True


class NodeLayout:
    """The data-parallel group's ranks by node (``nodes``: each node's global ranks, group order)."""

    def __init__(self, node_of: list[Any], ranks: list[int]):
        nodes: dict[Any, list[int]] = {}
        for node, r in zip(node_of, ranks, strict=True):
            nodes.setdefault(node, []).append(r)
        self.nodes = list(nodes.values())

    @property
    def pays(self) -> bool:
        """Hierarchical moves fewer bytes across nodes only with several nodes, one of several
        ranks: a flat ring sends 2(W-1)/W of the buffer per rank over the node links (every rank's),
        the hierarchy 2(H-1)/H once per node."""
        return len(self.nodes) > 1 and max(len(n) for n in self.nodes) > 1

    @classmethod
    def gather(cls, process_group: Any = None) -> NodeLayout:
        """Each rank's node (``NODE_RANK`` from the launcher, else the host name), from all ranks.

        collective: all ranks of the group (setup metadata, not counted as gradient traffic).
        """
        mine = os.environ.get("NODE_RANK") or socket.gethostname()
        node_of: list[Any] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(node_of, mine, group=process_group)
        return cls(node_of, comm.get_all_ranks_from_group(process_group))


class HierarchicalAllReduce(GradientExchange):
    """Reduce within the node, all-reduce across one leader per node, broadcast within the node.

    The sum equals the flat one up to fp32 rounding (another summation order). Synchronous:
    the three phases depend on each other. Groups are created collectively at construction.
    """

    name = "hierarchical"

    def __init__(self, layout: NodeLayout, process_group: Any = None):
        super().__init__(process_group)
        me = dist.get_rank()
        self.node_group, members = new_groups(layout.nodes, me)
        self.leader = members[0]
        self.cross_group = new_groups([[members[0] for members in layout.nodes]], me)[0]

    def all_reduce(self, buf: torch.Tensor) -> Any:
        comm.reduce(buf, dst=self.leader, group=self.node_group)
        if self.cross_group is not None:
            comm.all_reduce(buf, group=self.cross_group)
        comm.broadcast(buf, src=self.leader, group=self.node_group)
        return None


class SharedMemoryExchange(GradientExchange):
    """The flat sum through same-host shared memory (``shm.SharedMemoryCollectives``): an
    all-reduce, or with ``owned_only`` a reduce-scatter into this rank's range (half the bytes
    moved at world 2). A bucket inside a buffer from ``gradient_buffer`` (stage 0/1's whole
    gradient, in shared memory) is summed in place, reading the peers' buffers (no copy in);
    any other goes through the slots. Synchronous; the sum is in group-rank order. A bucket on
    another device than the CPU takes the flat all-reduce."""

    name = "shared_memory"

    def __init__(self, shm: SharedMemoryCollectives, process_group: Any = None):
        super().__init__(process_group)
        self.shm = shm
        self.buffers: list[SharedTensors] = []

    def gradient_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        shared = SharedTensors.make(self.shm, numel, dtype) if device.type == "cpu" else None
        if shared is None:  # elsewhere, or no room in /dev/shm: private, summed through the slots
            return super().gradient_buffer(numel, dtype, device)
        self.buffers.append(shared)
        return shared.mine

    def _in_place(self, buf: torch.Tensor, lo: int, hi: int, scatter: bool) -> bool:
        """Sum ``buf`` in place where it lies in a shared gradient buffer; False: it does not."""
        for shared in self.buffers:
            at = shared.offset(buf)
            if at is not None:
                op = "reduce_scatter" if scatter else "all_reduce"  # the hang report's name, as gloo's
                shared.reduce(at, buf.numel(), lo, hi, scatter, f"{op} of gradients (shared memory)")
                return True
        return False

    def all_reduce(self, buf: torch.Tensor) -> Any:
        if not self.shm.applies(buf):
            return super().all_reduce(buf)
        if not self._in_place(buf, 0, 0, scatter=False):
            self.shm.all_reduce(buf)
        return None

    def reduce_bucket(self, buf: torch.Tensor, group: int, begin: int) -> Any:
        if not (self.owned_only and self.shm.applies(buf)):
            return self.all_reduce(buf)
        lay = self.layouts[group]
        lo, hi = max(0, lay.start - begin), min(buf.numel(), lay.end - begin)
        if not self._in_place(buf, lo, max(lo, hi), scatter=True):
            self.shm.reduce_scatter(buf, lay.start - begin, lay.end - begin)
        return None


class CompressedExchange(GradientExchange):
    """The flat all-reduce during a 1-bit optimizer's warm-up (through ``shm`` where given: the sum
    the other optimizers' exchange makes, so the warm-up is theirs bit for bit); no gradient
    exchange afterwards.

    The optimizer tells it the phase (``compressing``) and uses its error-feedback buffers, one
    pair per param group (``errors``). Those differ on every rank and are checkpointed per rank;
    they only fit the world size they were made at (``load_state_dict`` refuses another).
    """

    name = "compressed"
    needs_local_gradients = True

    def __init__(self, process_group: Any = None, world_size: int = 1, shm: SharedMemoryCollectives | None = None):
        super().__init__(process_group)
        self.world_size, self.shm = world_size, shm
        self.compressing: Callable[[], bool] = lambda: False  # set by the optimizer
        self.errors: dict[int, dict[str, torch.Tensor]] = {}  # group -> worker/server error

    def all_reduce(self, buf: torch.Tensor) -> Any:
        if self.compressing():
            return None
        if self.shm is not None and self.shm.applies(buf):
            self.shm.all_reduce(buf)
            return None
        return super().all_reduce(buf)

    def summed_ranks(self, world_size: int) -> int:
        return 1 if self.compressing() else world_size

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "world_size": self.world_size,
                "errors": {gi: dict(e) for gi, e in self.errors.items()}}

    def load_state_dict(self, sd: dict[str, Any] | None) -> None:
        """Restore this rank's error feedback (none saved, or none yet: start from zero).

        Raises:
            CheckpointError: the saved error feedback belongs to another world size.
        """
        errors = (sd or {}).get("errors") or {}
        if errors and sd["world_size"] != self.world_size:
            raise CheckpointError(
                f"the 1-bit optimizer's error-feedback state was saved at data-parallel world size "
                f"{sd['world_size']}, this run has {self.world_size}: it is per rank and cannot be "
                "resharded; resume at the same world size, or load with load_optimizer_states=False")
        self.errors = {int(gi): {k: v.clone() for k, v in e.items()} for gi, e in errors.items()}


def build_exchange(compressed: bool, hierarchical: str, process_group: Any = None,
                   shared_memory: str = "on", specs: list[GroupSpec] | None = None) -> GradientExchange:
    """The exchange for this engine: compressed for a 1-bit optimizer, else shared memory where
    every rank is on this host (gloo), else flat or hierarchical. Says which on rank 0's log.

    Args:
        compressed: the optimizer is a 1-bit one (it exchanges momentum itself after warm-up).
        hierarchical: ``"topology"`` (hierarchical where it pays, from each rank's node),
            ``"always"`` (wherever ranks share nodes) or ``"never"``.
        shared_memory: ``shared_memory_collectives``: ``"on"`` or ``"never"`` (``shm.wanted``).
        specs: the param groups, whose ``"data"`` ones this exchange sums: they bound a bucket's
            size, so the shared-memory slots (None: the largest, ``shm.SLOT_BYTES``).

    collective: all ranks (the hierarchical groups and the shared segment are created here).
    """
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    data = [g for g in specs if g.reduce_group == "data"] if specs is not None else None
    largest = SLOT_BYTES if data is None else largest_piece(data, world, whole=True, at_least=4)
    shm = SharedMemoryCollectives.build(process_group, shared_memory, largest)
    if compressed:
        return CompressedExchange(process_group, world, shm)
    if shm is not None:
        log_dist(f"ZeRO collectives: shared memory ({world} ranks on one host, {segment_directory()})", ranks=[0])
        return SharedMemoryExchange(shm, process_group)
    exchange: GradientExchange = FlatAllReduce(process_group)
    # Only over the whole world: every rank must create every group, and with several data-parallel
    # groups (pipeline stages, model parallel) each rank would create only its own group's.
    if world > 1 and hierarchical != "never" and world == dist.get_world_size():
        layout = NodeLayout.gather(process_group)
        if layout.pays or (hierarchical == "always" and max(len(n) for n in layout.nodes) > 1):
            exchange = HierarchicalAllReduce(layout, process_group)
    if world > 1:
        how = "hierarchical: within each node, then across nodes" if exchange.name == "hierarchical" else "flat"
        log_dist(f"ZeRO collectives: {dist.get_backend(process_group)}, {how} ({world} ranks)", ranks=[0])
    return exchange
