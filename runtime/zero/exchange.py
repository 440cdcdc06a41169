"""The gradient-communication seam: how a bucket of gradients is exchanged across the data-parallel group.

The bucket reducer (``reducer.py``) never calls a collective itself: it hands each bucket to the
strategy's ``GradientExchange``, picked once when the engine is built (``build_exchange``):

- ``FlatAllReduce``: one all-reduce (sum) over the data-parallel group; the default.
- ``HierarchicalAllReduce``: when several ranks share a node, reduce to one leader per node, all-reduce
  between the leaders, broadcast within the node; chosen from the topology (hosts x local ranks)
  where it moves fewer bytes across nodes.
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

from dslaunch.errors import CheckpointError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.parallel.groups import new_groups
from dslaunch.runtime.zero.partition import GroupLayout

__all__ = ["GradientExchange", "FlatAllReduce", "HierarchicalAllReduce", "CompressedExchange",
           "NodeLayout", "build_exchange"]


class GradientExchange:
    """Sums a gradient buffer over the data-parallel group, in place. Stateless by default.

    collective: ``all_reduce`` on all ranks of the group, same buffers, same order.
    """

    name = "flat"
    needs_local_gradients = False  # the optimizer reads each rank's full unreduced gradient

    def __init__(self, process_group: Any = None):
        self.pg = process_group
        self.layouts: list[GroupLayout] = []  # per param group: its params and this rank's [start, end)
        self.local_gradient: Callable[[int], torch.Tensor] | None = None

    def bind(self, layouts: list[GroupLayout], local_gradient: Callable[[int], torch.Tensor]) -> None:
        """Called by the strategy once built: each param group's layout on this rank, and a function
        returning group i's whole local gradient (where the strategy keeps it)."""
        self.layouts, self.local_gradient = layouts, local_gradient

    def all_reduce(self, buf: torch.Tensor) -> Any:
        """Start summing ``buf`` over the group; returns a handle to wait on (None: done)."""
        return comm.all_reduce(buf, group=self.pg, async_op=True)

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


class CompressedExchange(GradientExchange):
    """The flat all-reduce during a 1-bit optimizer's warm-up; no gradient exchange afterwards.

    The optimizer tells it the phase (``compressing``) and uses its error-feedback buffers, one
    pair per param group (``errors``). Those differ on every rank and are checkpointed per rank;
    they only fit the world size they were made at (``load_state_dict`` refuses another).
    """

    name = "compressed"
    needs_local_gradients = True

    def __init__(self, process_group: Any = None, world_size: int = 1):
        super().__init__(process_group)
        self.world_size = world_size
        self.compressing: Callable[[], bool] = lambda: False  # set by the optimizer
        self.errors: dict[int, dict[str, torch.Tensor]] = {}  # group -> worker/server error

    def all_reduce(self, buf: torch.Tensor) -> Any:
        return None if self.compressing() else super().all_reduce(buf)

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


def build_exchange(compressed: bool, hierarchical: str, process_group: Any = None) -> GradientExchange:
    """The exchange for this engine: compressed for a 1-bit optimizer, else flat or hierarchical.

    Args:
        compressed: the optimizer is a 1-bit one (it exchanges momentum itself after warm-up).
        hierarchical: ``"topology"`` (hierarchical where it pays, from each rank's node),
            ``"always"`` (wherever ranks share nodes) or ``"never"``.

    collective: all ranks (the hierarchical groups are created here).
    """
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    if compressed:
        return CompressedExchange(process_group, world)
    # Only over the whole world: every rank must create every group, and with several data-parallel
    # groups (pipeline stages, model parallel) each rank would create only its own group's.
    if world > 1 and hierarchical != "never" and world == dist.get_world_size():
        layout = NodeLayout.gather(process_group)
        if layout.pays or (hierarchical == "always" and max(len(n) for n in layout.nodes) > 1):
            return HierarchicalAllReduce(layout, process_group)
    return FlatAllReduce(process_group)
