"""Partitioned parameters (stage 3, ``zero.Init``): a shard per rank, gathered while in use.

A partitioned parameter lives as a range ``[offset, offset + ds_numel)`` of a flat vector split
across ranks by ``partition.partition_range`` (a ``FlatShard``: this rank's piece of it). In the
engine the flat vector is the param group's (the same layout as stages 1/2, so checkpoints and
``zero_to_fp32`` read stage 3 like any stage); under ``zero.Init``, before the engine exists, it is
the parameter alone. Between uses ``param.data`` is an empty placeholder. The parameter carries
DeepSpeed's attributes: ``ds_numel``, ``ds_shape``, ``ds_tensor`` (this rank's piece, 1-D; may be
empty: pieces follow the flat layout, not one equal piece per parameter), ``ds_status``
(``ZeroParamStatus``), ``ds_persist`` (kept whole: small parameters), ``ds_id`` and the method
``partition_numel()``.

Users (a module's forward, ``GatheredParameters``) ``hold`` a parameter and ``unhold`` it; it is
released when the last user is gone, unless persistent. Gathering a range: each owner broadcasts
its piece into the full buffer (as ``ShardPublisher``: on gloo a round of broadcasts beats
all_gather), every piece in flight at once. ``start_fetch`` only starts (the prefetch: the
parameter is ``INFLIGHT`` until a ``fetch`` of it waits); ``fetch`` starts and waits.

collective: ``fetch``/``hold``/``write_back`` of parameters that are not available run broadcasts:
call them on all ranks with the same parameters in the same order.
"""

from __future__ import annotations

import enum
import functools
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero.partition import partition_range, shard_slot

__all__ = ["ZeroParamStatus", "FlatShard", "is_partitioned", "attach", "start_fetch", "fetch", "hold", "unhold",
           "release", "gather_range", "SharedMemoryGather", "SharedShards", "fence", "flats", "owner_pieces", "global_rank",
           "write_back", "scatter_into"]

_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """DeepSpeed's parameter states: whole and usable, a placeholder, or being gathered."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@dataclass(frozen=True)
class FlatShard:
    """This rank's piece of a flat vector of ``numel`` elements split over ``world`` ranks.

    ``shard`` holds ``partition_range(numel, world, rank)``; ``master``, when not None, is an fp32
    copy of the same range that writes must update too (16-bit models in the engine, offload).
    """

    shard: torch.Tensor
    numel: int
    world: int
    rank: int
    group: Any = None
    master: torch.Tensor | None = None
    device: torch.device | None = None  # where gathered values go (None: the shard's device)
    # offload_param nvme: the shard's values live here (``offload.param_store.ShardStore``) and
    # ``shard`` is a meta tensor (shape and dtype only); go through ``read``/``write``.
    store: Any = None
    # how ranges are gathered: ZeRO++'s ``zeropp.ZeroPPGather``, ``SharedMemoryGather``, ``SharedShards``
    # (None: plain broadcasts)
    gatherer: Any = None

    def __reduce__(self) -> tuple:
        # A pickled parameter (torch.save of the Parameter keeps its attributes) is a placeholder
        # detached from its shard: it unpickles without one (and a process group cannot pickle).
        return type(None), ()

    @property
    def start(self) -> int:
        return partition_range(self.numel, self.world, self.rank)[0]

    @property
    def end(self) -> int:
        return partition_range(self.numel, self.world, self.rank)[1]

    def read(self, lo: int, hi: int, out: torch.Tensor) -> None:
        """Copy this rank's elements ``[lo, hi)`` (offsets into the shard) into ``out``."""
        if self.store is None:
            out.copy_(self.shard[lo:hi])
        else:
            self.store.read(lo, hi, out)

    def write(self, lo: int, src: torch.Tensor) -> None:
        """Store ``src`` as this rank's elements ``[lo, lo + src.numel())``."""
        if self.gatherer is not None:
            self.gatherer.invalidate()
        if self.store is None:
            self.shard[lo:lo + src.numel()].copy_(src)
        else:
            self.store.write(lo, src.reshape(-1))


def is_partitioned(t: Any) -> bool:
    return getattr(t, "_dsl_flat", None) is not None


def _placeholder(p: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=p.dtype, device=p.device)


def attach(p: torch.nn.Parameter, flat: FlatShard, offset: int, shape: torch.Size, persist: bool) -> None:
    """Make ``p`` the range [offset, offset + numel(shape)) of ``flat``; release it unless ``persist``.

    A persistent parameter keeps (or gets) its whole value in ``p.data``: the caller puts it there.
    """
    numel = shape.numel()
    lo, hi = max(offset, flat.start), min(offset + numel, flat.end)
    p._dsl_flat, p._dsl_offset = flat, offset
    p.ds_numel, p.ds_shape, p.ds_persist = numel, torch.Size(shape), persist
    p.ds_tensor = flat.shard[lo - flat.start:hi - flat.start] if hi > lo else flat.shard[:0]
    if not hasattr(p, "ds_id"):
        p.ds_id = next(_IDS)
    p.partition_numel = functools.partial(_partition_numel, p)
    p._dsl_users = getattr(p, "_dsl_users", 0)
    if persist:
        p.ds_status = ZeroParamStatus.AVAILABLE
    else:
        p.data = _placeholder(p)
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def _partition_numel(param: torch.nn.Parameter) -> int:
    """``param.partition_numel()``, DeepSpeed's: the elements of this rank's piece (Lightning's
    DeepSpeed model summary counts "Params per Device" with it)."""
    return param.ds_tensor.numel()


def gather_range(flat: FlatShard, a: int, b: int) -> tuple[torch.Tensor, list[Any]]:
    """Start gathering elements [a, b) of ``flat``'s vector on every rank.

    Returns the buffer (valid once every returned work is waited for) and the works.
    collective: all ranks, same ranges, same order.
    """
    if flat.gatherer is not None:
        return flat.gatherer.gather(flat, a, b, _broadcast_range)
    return _broadcast_range(flat, a, b)


def _broadcast_range(flat: FlatShard, a: int, b: int) -> tuple[torch.Tensor, list[Any]]:
    """``gather_range`` by plain broadcasts: each owner its piece, all in flight at once."""
    out = torch.empty(b - a, dtype=flat.shard.dtype, device=flat.device or flat.shard.device)
    k = shard_slot(flat.numel, flat.world)
    works = []
    for r, lo, hi in owner_pieces(flat, a, b):
        piece = out[lo - a:hi - a]
        if r == flat.rank:  # with offload_param nvme: read from the swap file
            flat.read(lo - r * k, hi - r * k, piece)
        if flat.world > 1:
            works.append(comm.broadcast(piece, src=global_rank(flat, r), group=flat.group, async_op=True))
    return out, works


class SharedMemoryGather:
    """``gather_range`` through same-host shared memory (``shm.py``): each owner writes its piece,
    every rank copies the others' (at once, no works to wait for). A ``FlatShard.gatherer``, as
    ZeRO++'s; ranges landing on another device than the CPU take the plain broadcasts."""

    def __init__(self, shm: Any):
        self.shm = shm

    def invalidate(self) -> None:
        """Nothing kept between gathers."""

    def gather(self, flat: FlatShard, a: int, b: int, plain: Any) -> tuple[torch.Tensor, list[Any]]:
        out = torch.empty(b - a, dtype=flat.shard.dtype, device=flat.device or flat.shard.device)
        if not self.shm.applies(out):
            return plain(flat, a, b)
        k = shard_slot(flat.numel, flat.world)
        outs = [out[:0]] * flat.world
        for r, lo, hi in owner_pieces(flat, a, b):
            outs[r] = out[lo - a:hi - a]
            if r == flat.rank:
                flat.read(lo - r * k, hi - r * k, outs[r])
        self.shm.all_gather(outs, "parameter gather (shared memory)")
        return out, []


class SharedShards:
    """``gather_range`` where every rank's shard itself lives in one shared segment
    (``shm.SharedTensors``: ``FlatShard.shard`` is ``buffers.mine``): a gather needs no wait and no
    work (``SharedMemoryGather`` waits for every rank at each one, which under load costs more
    than the copy). A range inside one owner's shard is gathered as a view of it, no copy and no
    memory (the whole parameters a step uses cost nothing beyond the shards); a range across
    owners is copied out of their shards. Such views are read only: ``hold`` (``GatheredParameters``,
    whose caller may write them) gives its parameters copies instead.

    The shards are read without asking their owners, so reads and writes are kept apart by
    ``fence`` (one wait of the group). After a write, before anyone reads: the placement's publish
    after each step's update, the start of each forward, ``hold``, after ``write_back``. After the
    reads, before anyone writes: the end of each forward, the end of the publish's refresh of
    persistent parameters, before ``write_back``; a backward's reads end before its last gradient
    reduction, which every rank passes before its update.
    """

    def __init__(self, shm: Any, buffers: Any):
        self.shm, self.buffers = shm, buffers  # buffers: ``shm.SharedTensors`` of one slot per rank

    def invalidate(self) -> None:
        """Nothing kept between gathers (writes are fenced by their callers, see above)."""

    def fence(self) -> None:
        """collective: every rank of the group got here (what any rank wrote before is visible)."""
        self.shm.wait("parameter shards (shared memory)")

    def gather(self, flat: FlatShard, a: int, b: int, plain: Any) -> tuple[torch.Tensor, list[Any]]:
        pieces = owner_pieces(flat, a, b)
        if len(pieces) == 1:  # one owner's shard holds the whole range: read it there
            r, lo, hi = pieces[0]
            k = shard_slot(flat.numel, flat.world)
            return self.buffers.views[r][lo - r * k:hi - r * k], []
        out = torch.empty(b - a, dtype=flat.shard.dtype, device=flat.device or flat.shard.device)
        self.gather_into(flat, a, b, out)
        return out, []

    def shares(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lies in the shared shards (a gathered view, not a copy)."""
        first, last = self.buffers.views[0], self.buffers.views[-1]
        return first.data_ptr() <= t.data_ptr() < last.data_ptr() + last.numel() * last.element_size()

    def gather_into(self, flat: FlatShard, a: int, b: int, out: torch.Tensor) -> None:
        """Elements [a, b) of ``flat``'s vector into contiguous ``out``. Local."""
        k = shard_slot(flat.numel, flat.world)
        for r, lo, hi in owner_pieces(flat, a, b):
            out[lo - a:hi - a].copy_(self.buffers.views[r][lo - r * k:hi - r * k])


def fence(flats: Iterable[FlatShard]) -> None:
    """Pass the ``fence`` of every ``SharedShards`` gatherer among ``flats`` (one wait per group of
    ranks). collective: all ranks, the same vectors."""
    seen: set[int] = set()
    for flat in flats:
        gatherer = flat.gatherer
        if isinstance(gatherer, SharedShards) and id(gatherer.shm) not in seen:
            seen.add(id(gatherer.shm))
            gatherer.fence()


def flats(params: Iterable[torch.nn.Parameter]) -> list[FlatShard]:
    """The flat vectors ``params`` are ranges of (each once; a parameter not partitioned has none)."""
    return list({id(p._dsl_flat): p._dsl_flat for p in params if is_partitioned(p)}.values())


def owner_pieces(flat: FlatShard, a: int, b: int) -> list[tuple[int, int, int]]:
    """Elements [a, b) of ``flat``'s vector cut by owner: (rank, lo, hi) in rank order."""
    k = shard_slot(flat.numel, flat.world)
    owners = range(a // k, min(flat.world, -(-b // k))) if b > a else range(0)
    return [(r, max(a, r * k), min(b, (r + 1) * k)) for r in owners]


def global_rank(flat: FlatShard, r: int) -> int:
    """Rank ``r`` of ``flat``'s process group in the default group (what collectives' ``src`` take)."""
    return r if flat.group is None else dist.get_global_rank(flat.group, r)


class _Gather:
    """One run of adjacent parameters being gathered: the buffer and the works to wait for."""

    __slots__ = ("run", "buf", "works")

    def __init__(self, run: list[torch.nn.Parameter], buf: torch.Tensor, works: list[Any]):
        self.run, self.buf, self.works = run, buf, works


def start_fetch(params: Iterable[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Start gathering every partitioned parameter in ``params`` that is not available; no wait.

    They become ``INFLIGHT`` until ``fetch`` (of any of them) waits. Parameters adjacent in the
    same flat vector (a module's weight and bias, usually) are gathered as one range: one
    broadcast per owning rank for the run, not per parameter. Returns the parameters started.
    collective: all ranks, the same parameters in the same order.
    """
    started: list[torch.nn.Parameter] = []
    for run in _runs([p for p in params if is_partitioned(p) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE]):
        first, last = run[0], run[-1]
        gather = _Gather(run, *gather_range(first._dsl_flat, first._dsl_offset, last._dsl_offset + last.ds_numel))
        for p in run:
            p.ds_status, p._dsl_gather = ZeroParamStatus.INFLIGHT, gather
        started.extend(run)
    return started


def fetch(params: Iterable[torch.nn.Parameter]) -> None:
    """Make every partitioned parameter in ``params`` whole: start what is not available, then
    wait for it and for what was already in flight (collective for those not available)."""
    params = list(params)
    start_fetch(params)
    gathers = {id(p._dsl_gather): p._dsl_gather for p in params
               if is_partitioned(p) and p.ds_status is ZeroParamStatus.INFLIGHT}
    for gather in gathers.values():
        _finish(gather)


def _finish(gather: _Gather) -> None:
    wait_all(gather.works, "parameter gather (broadcast)")
    base = gather.run[0]._dsl_offset
    for p in gather.run:
        p.data = gather.buf[p._dsl_offset - base:p._dsl_offset - base + p.ds_numel].view(p.ds_shape)
        p.ds_status, p._dsl_gather = ZeroParamStatus.AVAILABLE, None


def _runs(params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
    """``params`` (each once) split into runs that are contiguous in one flat vector, in an order
    every rank computes alike: by first appearance of the vector, then by offset."""
    unique = list({id(p): p for p in params}.values())
    order = {id(p._dsl_flat): i for i, p in reversed(list(enumerate(unique)))}
    unique.sort(key=lambda p: (order[id(p._dsl_flat)], p._dsl_offset))
    runs: list[list[torch.nn.Parameter]] = []
    for p in unique:
        prev = runs[-1][-1] if runs else None
        if prev is not None and prev._dsl_flat is p._dsl_flat and prev._dsl_offset + prev.ds_numel == p._dsl_offset:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def hold(params: list[torch.nn.Parameter]) -> None:
    """Fetch ``params`` and count one more user of each (after a ``fence``: a write before it is seen)."""
    fence(flats(params))
    fetch(params)
    for p in params:
        gatherer = p._dsl_flat.gatherer if is_partitioned(p) else None
        if isinstance(gatherer, SharedShards) and gatherer.shares(p.data):
            p.data = p.data.clone()  # the holder may write it: not into the owner's shard
        p._dsl_users += 1


def unhold(params: list[torch.nn.Parameter]) -> None:
    """One user fewer; release those nobody uses any more."""
    for p in params:
        p._dsl_users -= 1
    release(params)


def release(params: Iterable[torch.nn.Parameter]) -> None:
    """Back to a placeholder: every available, unused, non-persistent partitioned parameter."""
    for p in params:
        if (is_partitioned(p) and not p.ds_persist and p._dsl_users <= 0
                and p.ds_status is ZeroParamStatus.AVAILABLE):
            p.data = _placeholder(p)
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE


def scatter_into(p: torch.nn.Parameter, full: torch.Tensor) -> None:
    """Write the whole value ``full`` into this rank's piece of ``p`` (and its fp32 master). Local."""
    flat, off = p._dsl_flat, p._dsl_offset
    lo, hi = max(off, flat.start), min(off + p.ds_numel, flat.end)
    if hi <= lo:
        return
    src = full.reshape(-1)[lo - off:hi - off]
    flat.write(lo - flat.start, src)
    if flat.master is not None:
        flat.master[lo - flat.start:hi - flat.start].copy_(src)


def write_back(params: list[torch.nn.Parameter], src_rank: int) -> None:
    """Broadcast the whole values of ``params`` from rank ``src_rank`` of their group (DeepSpeed's
    ``modifier_rank``) and store them in every shard.

    collective: all ranks, the same available parameters.
    """
    works = [comm.broadcast(p.data, src=global_rank(p._dsl_flat, src_rank), group=p._dsl_flat.group,
                            async_op=True) for p in params if p._dsl_flat.world > 1]
    wait_all(works, "parameter write-back (broadcast)")
    vectors = flats(params)
    fence(vectors)  # nobody reads a shared shard while it changes
    for p in params:
        scatter_into(p, p.data)
    fence(vectors)
