"""ZeRO++ at stage 3: quantized parameter gathers (qwZ), a node-local secondary shard (hpZ) and
quantized two-hop gradient reduction (qgZ). DeepSpeed's keys in ``zero_optimization``:

- ``zero_quantized_weights``: a gather's owners send their pieces block-quantized to int8
  (``quantize.WEIGHTS``: one fp32 scale per 4096 values) and every rank, the owner too, decodes
  them, so all ranks compute with the same weights, and a backward re-gather (same shard, same
  blocks) gives the forward's values again.
- ``zero_hpz_partition_size`` (s > 1): every s consecutive ranks of a node (s = the ranks per node,
  or a divisor of it) also hold the flat vector split s ways (the secondary shard, model dtype,
  numel / s per rank). A gather from the primary shard fills it with what it gathered; a later
  gather of a range filled since the last update (backward's re-gathers, and the prefetches for
  backward that forward issues) reads from it, broadcasts within the node only. Anything writing
  the primary shard (the step's publish, a write-back, a checkpoint load) empties it.
- ``zero_quantized_gradients``: ``QuantizedReduceScatter`` (the strategy's ``GradientExchange``):
  each bucket is reduce-scattered in two all-to-alls, within the node then across nodes between
  ranks of the same local index, each message block-quantized to int4 (``quantize.GRADIENTS``),
  so each rank ends with the sum of the range it owns (stage 3 keeps only that). A rank's own
  share is added unquantized in both hops.

What crosses nodes per step for n parameters (W ranks on H nodes): ZeRO-3 sends the fp32 forward
and backward gathers and the fp32 gradient reduction; ZeRO++ sends the forward gather at ~1 byte
per value, no backward gather and the gradients at ~0.5 byte per value on the cross hop.

collective: every gather and reduction here runs on all ranks, same ranges, same order: the
decision (the secondary shard covers the range) is the same on every rank: every rank fills it by
the same gathers, completed in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.errors import ConfigError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.parallel.groups import new_groups
from dslaunch.runtime.zero.exchange import GradientExchange, NodeLayout
from dslaunch.runtime.zero.partition import partition_range, shard_slot
from dslaunch.runtime.zero.quantize import GRADIENTS, WEIGHTS, BlockQuant

__all__ = ["NodeGroups", "ZeroPPGather", "QuantizedReduceScatter"]


@dataclass(frozen=True)
class NodeGroups:
    """This rank's place in the topology: ``nodes`` (each node's global ranks), the process groups
    of its node (``node_group``), of the ranks of its local index on every node (``cross_group``)
    and of its secondary shard (``secondary``: global ranks, ``secondary_group``)."""

    nodes: tuple[tuple[int, ...], ...]
    node_index: int
    local: int
    node_group: Any
    cross_group: Any
    secondary: tuple[int, ...]
    secondary_group: Any

    @classmethod
    def build(cls, process_group: Any = None, secondary_size: int = 1, key: str = "") -> NodeGroups:
        """Nodes from ``NODE_RANK`` (else the host name) of every rank, and the groups above.

        Raises:
            ConfigError: the data-parallel group is not the whole world, or nodes differ in size
                where the layout needs equal ones, or ``secondary_size`` does not divide a node.

        collective: all ranks (every rank creates every group, torch's rule).
        """
        if dist.get_world_size(process_group) != dist.get_world_size():
            raise ConfigError("ZeRO++ needs the data-parallel group to be the whole world (no pipeline or "
                              "model parallelism beside it yet); remove it", key=key)
        nodes = [tuple(n) for n in NodeLayout.gather(process_group).nodes]
        me = dist.get_rank()
        sizes = {len(n) for n in nodes}
        if len(sizes) > 1 or next(iter(sizes)) % secondary_size:
            raise ConfigError(f"needs nodes with the same number of ranks, divisible by the secondary shard's "
                              f"{secondary_size}; this job has {sorted(len(n) for n in nodes)} ranks per node: "
                              "use 1 (off) or a divisor of the ranks per node", key=key)
        node_index = next(i for i, n in enumerate(nodes) if me in n)
        local = nodes[node_index].index(me)
        node_group = new_groups(nodes, me)[0]
        cross_group = new_groups([[n[j] for n in nodes] for j in range(len(nodes[0]))], me)[0]
        chunks = [n[c:c + secondary_size] for n in nodes for c in range(0, len(n), secondary_size)]
        secondary = next(chunk for chunk in chunks if me in chunk)
        secondary_group = new_groups(chunks, me)[0] if secondary_size > 1 else None
        return cls(tuple(nodes), node_index, local, node_group, cross_group, secondary, secondary_group)


class _Pending:
    """A gather's broadcasts and what to do once they are done (decode, fill the secondary shard):
    ``wait`` as a ``torch.distributed`` work."""

    __slots__ = ("works", "then")

    def __init__(self, works: list[Any], then: Any):
        self.works, self.then = works, then

    def wait(self) -> None:
        wait_all(self.works, "parameter gather (broadcast)")
        if self.then is not None:
            self.then()
            self.then = None


class ZeroPPGather:
    """How one flat vector's ranges are gathered with qwZ and/or hpZ (``params.gather_range``).

    Args:
        topo: the node groups (hpZ's secondary group among them).
        numel, dtype, device: the flat vector's length, the model dtype, where gathers land.
        quantized: int8 gathers from the primary shard (qwZ).
    """

    def __init__(self, topo: NodeGroups, numel: int, dtype: torch.dtype, device: torch.device, quantized: bool):
        self.topo, self.numel, self.quantized = topo, numel, quantized
        s = len(topo.secondary)
        self.sec_index = topo.secondary.index(dist.get_rank())
        self.sec_range = partition_range(numel, s, self.sec_index)
        # hpZ's secondary shard: this rank's 1/s of the whole vector (None: no hpZ)
        self.secondary = torch.empty(self.sec_range[1] - self.sec_range[0], dtype=dtype, device=device) \
            if s > 1 else None
        self.filled: list[tuple[int, int]] = []  # disjoint ranges gathered since the last update
        self.secondary_gathers = 0  # backward gathers served by the secondary shard (tests read it)

    def invalidate(self) -> None:
        """The primary shard changed: the secondary shard is stale until forward fills it again."""
        self.filled.clear()

    def covers(self, a: int, b: int) -> bool:
        return any(x <= a and b <= y for x, y in self.filled)

    def gather(self, flat: Any, a: int, b: int, plain: Any) -> tuple[torch.Tensor, list[Any]]:
        """Start gathering [a, b): from the secondary shard where a gather from the primary already
        brought the range since the last update (backward's, and prefetches for backward issued
        during forward), else from the primary (int8 with qwZ; ``plain(flat, a, b)`` without).
        Returns the buffer and the works to wait for (the buffer is valid after)."""
        if self.secondary is not None and self.covers(a, b):
            self.secondary_gathers += 1
            return self._from_secondary(a, b)
        if self.quantized:
            out, works, decode = self._quantized(flat, a, b)
        else:
            (out, works), decode = plain(flat, a, b), None

        def then() -> None:
            if decode is not None:
                decode()
            if self.secondary is not None:
                self._fill(out, a, b)
        return out, [_Pending(works, then)]

    def _quantized(self, flat: Any, a: int, b: int) -> tuple[torch.Tensor, list[Any], Any]:
        from dslaunch.runtime.zero.params import global_rank, owner_pieces

        out = torch.empty(b - a, dtype=flat.shard.dtype, device=flat.device or flat.shard.device)
        k = shard_slot(flat.numel, flat.world)
        works, msgs = [], []
        for r, lo, hi in owner_pieces(flat, a, b):
            msg = torch.empty(WEIGHTS.packed_bytes(hi - lo), dtype=torch.uint8, device=out.device)
            if r == flat.rank:
                mine = torch.empty(hi - lo, dtype=flat.shard.dtype, device=out.device)
                flat.read(lo - r * k, hi - r * k, mine)
                WEIGHTS.quantize(mine, out=msg)
            if flat.world > 1:
                works.append(comm.broadcast(msg, src=global_rank(flat, r), group=flat.group, async_op=True))
            msgs.append((msg, lo, hi))

        def decode() -> None:
            for msg, lo, hi in msgs:
                WEIGHTS.dequantize(msg, hi - lo, out[lo - a:hi - a])
        return out, works, decode

    def _fill(self, out: torch.Tensor, a: int, b: int) -> None:
        lo, hi = max(a, self.sec_range[0]), min(b, self.sec_range[1])
        if hi > lo:
            self.secondary[lo - self.sec_range[0]:hi - self.sec_range[0]].copy_(out[lo - a:hi - a])
        self.filled = _merged([*self.filled, (a, b)])

    def _from_secondary(self, a: int, b: int) -> tuple[torch.Tensor, list[Any]]:
        out = torch.empty(b - a, dtype=self.secondary.dtype, device=self.secondary.device)
        s = len(self.topo.secondary)
        k = shard_slot(self.numel, s)
        works = []
        for j in range(a // k, min(s, -(-b // k))):
            lo, hi = max(a, j * k), min(b, (j + 1) * k)
            piece = out[lo - a:hi - a]
            if j == self.sec_index:
                piece.copy_(self.secondary[lo - j * k:hi - j * k])
            works.append(comm.broadcast(piece, src=self.topo.secondary[j], group=self.topo.secondary_group,
                                        async_op=True))
        return out, works


def build_gathers(comm_settings: Any, process_group: Any, groups_numel: list[tuple[int, torch.dtype, torch.device]]
                  ) -> list[ZeroPPGather | None]:
    """One ``ZeroPPGather`` per param group when qwZ or hpZ is on, else Nones. collective: all ranks."""
    hpz = comm_settings.hpz_partition_size
    if not comm_settings.quantized_weights and hpz == 1:
        return [None] * len(groups_numel)
    topo = NodeGroups.build(process_group, hpz, key="zero_optimization.zero_hpz_partition_size")
    return [ZeroPPGather(topo, n, dtype, device, comm_settings.quantized_weights) for n, dtype, device in groups_numel]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranges`` as disjoint ranges, touching ones joined (a backward gather may span several
    forward gathers: adjacent modules' parameters in one run)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


class QuantizedReduceScatter(GradientExchange):
    """qgZ: each gradient bucket summed into the range each rank owns, int4 in two hops.

    Hop 1 (all-to-all in the node): local rank j gets, from every rank of its node, the bucket's
    pieces owned by the ranks of local index j (one per node), and sums them. Hop 2 (all-to-all
    between the ranks of local index j): each gets the node sums of its own piece and sums them.
    Only the owned range of the bucket is valid afterwards (what ``ShardedGradients`` keeps).
    Synchronous (the hops depend on each other).
    """

    name = "quantized"

    def __init__(self, topo: NodeGroups, process_group: Any = None, quant: BlockQuant = GRADIENTS):
        super().__init__(process_group)
        self.topo, self.quant = topo, quant
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)

    @classmethod
    def build(cls, process_group: Any = None) -> QuantizedReduceScatter:
        """collective: all ranks (creates the node and cross-node groups)."""
        return cls(NodeGroups.build(process_group, 1, key="zero_optimization.zero_quantized_gradients"),
                   process_group)

    def reduce_bucket(self, buf: torch.Tensor, group: int, begin: int) -> Any:
        numel = self.layouts[group].numel
        k, end = shard_slot(numel, self.world), begin + buf.numel()

        def piece(r: int) -> tuple[int, int]:  # rank r's owned part of the bucket, as offsets into buf
            lo, hi = max(begin, r * k), min(end, (r + 1) * k, numel)
            return (lo - begin, max(lo, hi) - begin)

        nodes, j, h = self.topo.nodes, self.topo.local, self.topo.node_index
        # hop 1: to local rank i, the pieces of the ranks of local index i, node by node
        src = buf.float()
        to_local = [torch.cat([src[slice(*piece(n[i]))] for n in nodes]) for i in range(len(nodes[0]))]
        mine = [piece(n[j]) for n in nodes]
        node_sum = self._all_to_all(to_local, sum(b - a for a, b in mine), j, self.topo.node_group)
        # hop 2: to node g, the node sum of the piece of its rank of local index j
        sizes = [b - a for a, b in mine]
        own = piece(nodes[h][j])
        total = self._all_to_all(list(node_sum.split(sizes)), own[1] - own[0], h, self.topo.cross_group)
        buf[slice(*own)].copy_(total)
        return None

    def _all_to_all(self, messages: list[torch.Tensor], n_in: int, me: int, group: Any) -> torch.Tensor:
        """Send ``messages[i]`` to member i of ``group`` (int4) and return the sum of what every
        member sent this rank (``n_in`` values each); this rank's own message is added exact."""
        acc = messages[me].clone()
        if len(messages) == 1:
            return acc
        q = self.quant
        send = torch.cat([q.quantize(m) for m in messages])
        recv = torch.empty(q.packed_bytes(n_in) * len(messages), dtype=torch.uint8, device=send.device)
        comm.all_to_all_single(recv, send, output_split_sizes=[q.packed_bytes(n_in)] * len(messages),
                               input_split_sizes=[q.packed_bytes(m.numel()) for m in messages], group=group)
        for i, msg in enumerate(recv.split(q.packed_bytes(n_in))):
            if i != me:
                q.add_decoded(msg, n_in, acc)
        return acc
