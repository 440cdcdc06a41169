"""Same-host shared-memory collectives for the ZeRO engine's CPU ranks (``shared_memory_collectives``).

On gloo every byte a rank sends to a rank on the same host goes through loopback TCP: copied
into the kernel and out again, by the same two cores that compute (measured here: an 84 MB
all-reduce at world 2 takes 82 ms, the publish of the updated shards 33 ms). When every rank of
the data-parallel group runs on this host and the tensors are on the CPU, the engine's bulk
collectives go through one mapped file in ``/dev/shm`` instead: each rank copies its part into
its slot, waits for its peers, and reads theirs.

- ``all_reduce``: rank r sums piece r of every rank's slot and writes it back to its slot; a
  second wait, then every rank copies the other pieces out (stage 0/1 gradients).
- ``reduce_scatter``: every rank sums only its own range from every slot into its buffer: one
  wait, each byte written once and read once (stage 2/3 gradients).
- ``all_gather``: each rank writes its range, waits, and copies everyone else's (the stage 1/2
  publish, stage 3's parameter gathers).

Sum order: every element is added in group-rank order, ``((r0 + r1) + r2) + ...``, whatever the
bucket or piece boundaries, in every stage; so stages 0-3 get the same bits at any world size,
and at world 2 the bits of gloo's sum (``a + b == b + a``). ``layout_invariant`` keeps its own
``TreeAllReduce``.

Waits are a one-element ``all_reduce`` on the group inside ``heartbeat.waiting(name)``: a rank
that is late is blamed by the monitor as for any collective, and a dead peer fails the wait at once
(gloo notices a closed connection). The comms logger (``dslaunch.comm``'s) counts each operation
once under the collective's name (``all_reduce``, ``reduce_scatter``, ``all_gather``) with the
bytes this rank contributes, as gloo's would be; its waits are not collectives of their own there. Two slot sets alternate
per operation: a rank starts writing operation n+2 only after it passed operation n+1's wait,
which every rank reaches only after it finished reading operation n.

Memory: ``2 * world * slot`` of shared pages per group, reserved in the segment directory when
the transport is built (no room there: gloo from the start), where ``slot`` is the largest piece
one operation of the group can move (``largest``, which the caller bounds from its param groups'
sizes: a whole padded group of gradients, one rank's shard of weights), rounded up to 64 bytes and
at most ``SLOT_BYTES``: a small model's group holds little, a larger one ``2 * world * 8 MiB``
(world 2: 32 MiB), whatever the model or bucket size (larger tensors go through in slot-sized
pieces). Mapped by every rank (RssShmem). The file is unlinked as soon as every rank mapped it
(``inference.shm_allreduce.map_segment``): a killed job leaves nothing in ``/dev/shm``.

Switch: the ds_config key ``shared_memory_collectives`` (``"on"``, the default: wherever it
applies; ``"never"``: gloo), overridden by ``DSLAUNCH_SHM_COLLECTIVES`` in the environment (``0``
off for debugging, ``1`` on whatever the config says: the suite run through it).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.inference.shm_allreduce import DIRECTORY_ENV, map_segment, same_host, segment_directory
from dslaunch.runtime.zero.partition import partition_range
from dslaunch.utils.logging import log_dist

__all__ = ["SharedMemoryCollectives", "SharedTensors", "SLOT_BYTES", "ENV_SWITCH", "wanted", "slot_size"]

SLOT_BYTES = 8 << 20
"""One rank's slot per slot set: the largest piece one wait moves (fewer waits against more
shared memory; 8 MiB: ~11 pieces for 84 MB of gradients)."""
ENV_SWITCH = "DSLAUNCH_SHM_COLLECTIVES"
"""``0`` (or ``off``/``never``/``false``) turns the transport off, ``1`` (``on``/``true``) on,
whatever the config says."""


def slot_size(largest: int) -> int:
    """One rank's slot for operations of at most ``largest`` bytes: that, rounded up to 64 bytes
    (a cache line, so that slots never share one), and at most ``SLOT_BYTES``."""
    return max(64, min(SLOT_BYTES, -(-largest // 64) * 64))


def wanted(setting: str) -> bool:
    """Whether the transport is wanted: the environment's ``ENV_SWITCH`` if set, else the config's
    ``shared_memory_collectives``."""
    forced = os.environ.get(ENV_SWITCH, "").strip().lower()
    if forced in ("0", "off", "never", "false"):
        return False
    return forced in ("1", "on", "true") or setting != "never"


class SharedMemoryCollectives:
    """The shared-memory collectives of one process group whose ranks share this host.

    collective: construct (``build``) and call on every rank of the group, in the same order, with
    the same sizes. CPU tensors only (the callers check ``applies``).
    """

    def __init__(self, group: Any, slot_bytes: int = SLOT_BYTES, segment: Any = None):
        self.group, self.slot_bytes = group, slot_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # the slots: ``segment`` (``2 * world * slot_bytes`` or more, from ``build``), else mapped here
        self._map = segment or map_segment(group, self.nbytes(self.world, slot_bytes), "zero")
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._set = 0  # the slot set the next operation uses
        self._flag = torch.zeros(1, dtype=torch.int32)

    @staticmethod
    def nbytes(world: int, slot_bytes: int) -> int:
        """The segment of ``world`` ranks' slots: two sets of ``slot_bytes`` each."""
        return 2 * world * slot_bytes

    @classmethod
    def build(cls, group: Any, setting: str = "on", largest: int = SLOT_BYTES) -> SharedMemoryCollectives | None:
        """The transport for ``group`` where it applies (allowed, gloo, several ranks, one host),
        else None (the callers keep gloo). ``largest``: no operation the caller makes through the
        slots moves more bytes at once (an upper bound; the ranks' largest counts, so the slots
        are the same on every rank); 0 where only the waits and ``SharedTensors`` are used.
        collective: every rank of ``group``."""
        if not (wanted(setting) and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return None
        if dist.get_backend(group) != "gloo" or not same_host(group):
            return None
        agreed = torch.tensor([largest], dtype=torch.int64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
        slot = slot_size(int(agreed))
        # the slots are reserved here, so that a directory without room means gloo from the start
        nbytes = cls.nbytes(dist.get_world_size(group), slot)
        segment = map_segment(group, nbytes, "zero", optional=True)
        if segment is None:
            no_room("the slots", nbytes, "gloo")
            return None
        return cls(group, slot, segment)

    @staticmethod
    def applies(*tensors: torch.Tensor) -> bool:
        return all(t.device.type == "cpu" for t in tensors)

    def _slots(self, dtype: torch.dtype) -> list[torch.Tensor]:
        """Every rank's whole slot of the current set as values of ``dtype``, in rank order."""
        base, n = self._set * self.world * self.slot_bytes, self.slot_bytes // dtype.itemsize * dtype.itemsize
        return [self._bytes[base + r * self.slot_bytes:base + r * self.slot_bytes + n].view(dtype)
                for r in range(self.world)]

    def wait(self, name: str) -> None:
        """Every rank of the group got here (a one-element collective, blamed as ``name``; not
        through ``dslaunch.comm``: the logger counts the operation, ``counted``, not its waits)."""
        wait_all((dist.all_reduce(self._flag, group=self.group, async_op=True),), name)

    def counted(self, op: str, nbytes: int, start: float) -> None:
        """Record operation ``op`` begun at ``start`` (``time.perf_counter``), ``nbytes`` from this
        rank, in the comms logger where it counts ``op``."""
        logger = comm.comms_logger
        if logger.enabled and logger.wants(op, False):
            logger.append(op, op, (time.perf_counter() - start) * 1000.0, nbytes, self.world,
                                     dist.get_rank())

    def _pieces(self, numel: int, dtype: torch.dtype) -> range:
        return range(0, numel, max(1, self.slot_bytes // dtype.itemsize))

    def _publish(self, piece: torch.Tensor, name: str) -> list[torch.Tensor]:
        """Write ``piece`` (at most a slot) into this rank's slot of the next set, wait for every
        rank to have written its own, and return all slots (valid until the operation after next)."""
        slots = self._slots(piece.dtype)
        self._set ^= 1
        slots[self.rank][:piece.numel()].copy_(piece)
        self.wait(name)
        return slots

    def all_reduce(self, buf: torch.Tensor, name: str = "all_reduce of gradients (shared memory)") -> None:
        """Sum contiguous ``buf`` over the group, in place."""
        flat, start = buf.view(-1), time.perf_counter()
        for at in self._pieces(flat.numel(), flat.dtype):
            piece = flat[at:at + self.slot_bytes // flat.element_size()]
            slots = self._publish(piece, name)
            # which rank sums which part: any cut the ranks agree on gives the same bits (the order
            # is per element); the shards' cut, so that "rank r's part" has one rule
            lo, hi = partition_range(piece.numel(), self.world, self.rank)
            _sum([s[lo:hi] for s in slots], out=piece[lo:hi])
            slots[self.rank][lo:hi].copy_(piece[lo:hi])
            self.wait(name)
            for r in range(self.world):
                if r != self.rank:
                    a, b = partition_range(piece.numel(), self.world, r)
                    piece[a:b].copy_(slots[r][a:b])
        self.counted("all_reduce", flat.numel() * flat.element_size(), start)

    def reduce_scatter(self, buf: torch.Tensor, lo: int, hi: int,
                       name: str = "reduce_scatter of gradients (shared memory)") -> None:
        """Sum over the group only ``buf[lo:hi]`` (this rank's range; the ranks' ranges may
        differ); the rest of ``buf`` is left as it was."""
        flat, start = buf.view(-1), time.perf_counter()
        step = max(1, self.slot_bytes // flat.element_size())
        for at in self._pieces(flat.numel(), flat.dtype):
            piece = flat[at:at + step]
            slots = self._publish(piece, name)
            a, b = max(lo, at) - at, min(hi, at + piece.numel()) - at
            if a < b:
                _sum([s[a:b] for s in slots], out=piece[a:b])
        self.counted("reduce_scatter", max(0, min(hi, flat.numel()) - max(lo, 0)) * flat.element_size(), start)

    def all_gather(self, outs: Sequence[torch.Tensor], name: str = "parameter gather (shared memory)") -> None:
        """Every rank's ``outs[r]`` filled from rank r's ``outs[r]`` (contiguous 1-D, the same
        lengths on every rank; this rank's own is the input)."""
        mine, dtype, start = outs[self.rank], outs[self.rank].dtype, time.perf_counter()
        longest = max(o.numel() for o in outs)
        step = max(1, self.slot_bytes // dtype.itemsize)
        for at in self._pieces(longest, dtype):
            slots = self._publish(mine[at:at + step], name)
            for r, out in enumerate(outs):
                n = min(step, out.numel() - at)
                if r != self.rank and n > 0:
                    out[at:at + n].copy_(slots[r][:n])
        self.counted("all_gather", mine.numel() * dtype.itemsize, start)


class SharedTensors:
    """A buffer of ``numel`` values per rank, all in one shared segment: ``mine`` is this rank's,
    ``views[r]`` rank r's. For the buffers a collective reads in place (stage 0/1's gradient
    buffer, stage 1/2's flat weights): peers read each other's instead of a copy in a slot. This is
    not a second copy: the buffer replaces the private one (each rank's RSS counts the peers' pages
    it reads, as RssShmem; the host holds each buffer once).

    collective: construct on every rank of ``shm``'s group.
    """

    def __init__(self, shm: SharedMemoryCollectives, numel: int, dtype: torch.dtype, segment: Any = None):
        self.shm, self.numel = shm, numel
        self._map = segment or map_segment(shm.group, self.nbytes(shm, numel, dtype), "zero-buf")
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        size = numel * dtype.itemsize
        self.views = [whole[r * size:(r + 1) * size].view(dtype) for r in range(shm.world)]
        self.mine = self.views[shm.rank]

    @staticmethod
    def nbytes(shm: SharedMemoryCollectives, numel: int, dtype: torch.dtype) -> int:
        return max(1, shm.world * numel * dtype.itemsize)

    @classmethod
    def make(cls, shm: SharedMemoryCollectives, numel: int, dtype: torch.dtype) -> SharedTensors | None:
        """The buffers, or None on every rank where the segment directory has no room for them
        (said on rank 0): the caller keeps a private buffer, its collectives go through the slots."""
        nbytes = cls.nbytes(shm, numel, dtype)
        segment = map_segment(shm.group, nbytes, "zero-buf", optional=True)
        if segment is None:
            no_room("a shared buffer", nbytes, "private memory, through the slots (slower)")
            return None
        return cls(shm, numel, dtype, segment)

    def offset(self, t: torch.Tensor) -> int | None:
        """Where contiguous ``t`` starts in ``mine`` (elements), None if it is not inside it."""
        at = (t.data_ptr() - self.mine.data_ptr()) // max(1, t.element_size())
        inside = t.dtype == self.mine.dtype and 0 <= at and at + t.numel() <= self.numel and t.is_contiguous()
        return at if inside else None

    def reduce(self, at: int, n: int, lo: int, hi: int, scatter: bool, name: str) -> None:
        """Sum elements [at, at + n) of every rank's buffer, in place: with ``scatter`` only this
        rank's [lo, hi) of them (offsets into the range), else all of it on every rank. Every
        rank must have written the range; afterwards no rank reads a peer's range any more."""
        shm, mine, start = self.shm, self.mine, time.perf_counter()
        shm.wait(name)  # every rank wrote the range
        if not scatter:
            lo, hi = partition_range(n, shm.world, shm.rank)
        if lo < hi:
            parts = [v[at + lo:at + hi] for v in self.views]
            if shm.rank < 2:  # the output is one of the first two operands: in place is exact
                _sum(parts, out=mine[at + lo:at + hi])
            else:
                mine[at + lo:at + hi].copy_(_summed(parts))
        shm.wait(name)  # every rank summed its range
        if not scatter:
            for r in range(shm.world):
                a, b = partition_range(n, shm.world, r)
                if r != shm.rank and a < b:
                    mine[at + a:at + b].copy_(self.views[r][at + a:at + b])
            shm.wait(name)  # every rank read the sums: the buffers may be written again
        shm.counted("reduce_scatter" if scatter else "all_reduce", (hi - lo if scatter else n) * mine.element_size(),
                    start)

    def gather(self, ranges: Sequence[tuple[int, int]], name: str) -> None:
        """Copy rank r's ``ranges[r]`` of its buffer into this rank's, for every other rank (each
        rank wrote its own range)."""
        start = time.perf_counter()
        self.shm.wait(name)
        for r, (a, b) in enumerate(ranges):
            if r != self.shm.rank and a < b:
                self.mine[a:b].copy_(self.views[r][a:b])
        self.shm.wait(name)
        a, b = ranges[self.shm.rank]
        self.shm.counted("all_gather", max(0, b - a) * self.mine.element_size(), start)


def no_room(what: str, nbytes: int, instead: str) -> None:
    """Say on rank 0 that the segment directory had no room for ``what`` and what is used instead."""
    directory = segment_directory()
    try:
        free = f"{shutil.disk_usage(directory).free >> 20} MiB free"
    except OSError as err:
        free = err.strerror or "missing"
    size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{-(-nbytes >> 10)} KiB"
    log_dist(f"ZeRO collectives: {directory} has no room for {what} ({size}; {free}): {instead}; "
             f"give it more (docker run --shm-size) or set {DIRECTORY_ENV} to a larger tmpfs",
             ranks=[0], level=logging.WARNING)


def _summed(parts: list[torch.Tensor]) -> torch.Tensor:
    out = torch.empty_like(parts[0])
    _sum(parts, out)
    return out


def _sum(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out = ((parts[0] + parts[1]) + parts[2]) + ...``: group-rank order, for every element."""
    torch.add(parts[0], parts[1], out=out)
    for p in parts[2:]:
        out.add_(p)
