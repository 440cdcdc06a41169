"""A shared-memory all-reduce for tensor-parallel ranks on one host.

Tensor parallelism all-reduces one small activation per row-parallel layer per token (a few KB
when decoding): on gloo that costs a TCP round trip through the kernel. Here every rank of the
group maps one file in ``/dev/shm``: rank ``r`` copies its tensor into its slot, publishes a step
counter, waits until every rank's counter reached the step, and sums all slots in rank order,
so every rank computes the same bits (gloo's result, up to the order of a sum over more than 2).

Two slot sets alternate by step parity: a rank can only start step n+2 (overwriting step n's
slots) after every rank published step n+1, i.e. after every rank finished reading step n. A
tensor larger than a slot is reduced in slot-sized pieces. The file is unlinked as soon as
every rank has mapped it: nothing is left in ``/dev/shm`` whatever happens to the job.

collective: construct and call on every rank of the group, in the same order, with tensors of
the same size. A rank that never arrives is reported after ``timeout_s`` (never a silent hang).

Limitations: CPU tensors only; relies on x86's store order (a step counter is written after its
data, by separate calls); spinning ranks yield the core, but more ranks than cores are slow.
"""

from __future__ import annotations

import mmap
import os
import re
import socket
import time
import uuid
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dslaunch.errors import DslaunchError

__all__ = ["ShmAllReduce", "same_host", "map_segment", "segment_directory"]

_HEADER = 4096  # the step counters, one cache line each
_LINE = 64 // 8  # int64s per cache line


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _network_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return ""


def same_host(group: Any) -> bool:
    """Whether every rank of ``group`` runs on this host (same host name, boot and network
    namespace: hosts made of namespaces on one machine, as the test cluster's, are hosts apart).

    collective: every rank of ``group``.
    """
    mine = f"{socket.gethostname()}|{_boot_id()}|{_network_namespace()}"
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return all(x == mine for x in everyone)


class ShmAllReduce:
    """``__call__(tensor)`` sums ``tensor`` in place over ``group`` through shared memory;
    ``all_gather_last_dim`` concatenates every rank's slice (vocab-parallel logits).

    collective: construct on every rank of ``group``.

    Raises:
        DslaunchError: the file cannot be made or mapped (no ``/dev/shm``), or a peer is missing
            for ``timeout_s`` during a call.
    """

    def __init__(self, group: Any, slot_bytes: int = 1 << 20, timeout_s: float = 300.0, directory: str | None = None):
        self.group, self.timeout_s, self.slot_bytes = group, timeout_s, slot_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self._map = map_segment(group, _HEADER + 2 * self.world * slot_bytes, "tp", directory)
        self._steps = np.frombuffer(self._map, dtype=np.int64, count=_HEADER // 8)
        self._counters = self._steps[: self.world * _LINE : _LINE]  # every rank's published step
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER)
        self._step = 0
        # Slot views by (phase, dtype, numel): decoding all-reduces the same few shapes every
        # token, and making views costs more than the copy of a few KB itself.
        self._views: dict[tuple[int, torch.dtype, int], tuple[torch.Tensor, ...]] = {}

    def _slots(self, phase: int, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, ...]:
        """Every rank's slot of ``phase`` as ``numel`` values of ``dtype``, in rank order."""
        key = (phase, dtype, numel)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:  # prompts of ever new lengths: keep the table small
                self._views.clear()
            starts = ((phase * self.world + r) * self.slot_bytes for r in range(self.world))
            views = tuple(self._bytes[a:a + numel * dtype.itemsize].view(dtype) for a in starts)
            self._views[key] = views
        return views

    def _wait(self, step: int) -> None:
        counters = self._counters
        if counters.min() >= step:  # the peers were first: no spin bookkeeping
            return
        spins, deadline = 0, None
        while counters.min() < step:
            spins += 1
            if spins > 64:
                os.sched_yield()  # more ranks than free cores: let the others run
            if spins % 4096 == 0:
                deadline = deadline or time.monotonic() + self.timeout_s
                if time.monotonic() > deadline:
                    late = [r for r in range(self.world) if counters[r] < step]
                    raise DslaunchError(f"shared-memory all-reduce: rank(s) {late} of the tensor-parallel group "
                                        f"did not arrive within {self.timeout_s:.0f} s (step {step})")

    def _exchange(self, piece: torch.Tensor) -> list[torch.Tensor]:
        """Publish ``piece`` (at most a slot) and return every rank's, in rank order (valid until
        the step after next)."""
        self._step += 1
        slots = self._slots(self._step % 2, piece.dtype, piece.numel())
        slots[self.rank].copy_(piece.reshape(-1))
        self._counters[self.rank] = self._step  # published after the data (x86 keeps store order)
        self._wait(self._step)
        return slots

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
        per_piece = self.slot_bytes // flat.element_size()
        for start in range(0, flat.numel(), per_piece):
            piece = flat[start:start + per_piece] if flat.numel() > per_piece else flat
            slots = self._exchange(piece)
            torch.add(slots[0], slots[1], out=piece)  # the same order as before: bits equal to gloo's
            for other in slots[2:]:
                piece.add_(other)
        if flat.data_ptr() != tensor.data_ptr():
            tensor.copy_(flat.view_as(tensor))
        return tensor

    def fits_gather(self, local: torch.Tensor, widths: list[int]) -> bool:
        return local.numel() // local.shape[-1] * max(widths) * local.element_size() <= self.slot_bytes

    def all_gather_last_dim(self, local: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """Every rank's ``local`` (``[..., widths[r]]``) concatenated along the last dimension.
        The caller checks ``fits_gather`` first (one slot per rank)."""
        rows = local.numel() // local.shape[-1]
        padded = torch.zeros(rows, max(widths), dtype=local.dtype)
        padded[:, : local.shape[-1]] = local.reshape(rows, -1)
        slots = self._exchange(padded)
        parts = [s.view(rows, -1)[:, :w] for s, w in zip(slots, widths, strict=True)]
        return torch.cat(parts, dim=-1).view(*local.shape[:-1], sum(widths))


_SEGMENT = re.compile(r"dslaunch-shm-[a-z-]+-(\d+)-[0-9a-f]{12}")
"""A segment's file name: its tag, the creating process's id, a random part (``map_segment``)."""
ORPHAN_AGE_S = 60.0
"""A segment whose creator is gone is removed once this old: not while a creator in another pid
namespace sharing the directory (which looks gone from here) may still be in its setup."""


DIRECTORY_ENV = "DSLAUNCH_SHM_DIR"
"""Where the segments are made (default ``/dev/shm``): any tmpfs the ranks share, e.g. where a
container's ``/dev/shm`` is small."""


def segment_directory() -> str:
    """``DIRECTORY_ENV``'s directory, else ``/dev/shm``.

    Raises:
        DslaunchError: ``DIRECTORY_ENV`` names no directory (a typo is not "no room": the user
            asked for that place, so gloo in its stead would hide the mistake).
    """
    chosen = os.environ.get(DIRECTORY_ENV)
    if chosen and not os.path.isdir(chosen):
        raise DslaunchError(f"{DIRECTORY_ENV}={chosen[:200]}: not a directory; name a tmpfs directory "
                            "every rank on the host shares (e.g. /dev/shm), or unset it")
    return chosen or "/dev/shm"


def map_segment(group: Any, size: int, tag: str, directory: str | None = None,
                optional: bool = False) -> mmap.mmap | None:
    """A ``size``-byte file in ``directory`` (``segment_directory()``) mapped shared by every rank
    of ``group``: rank 0 creates it, the others attach, and it is unlinked once all have mapped it
    (or failed to), so nothing stays in ``directory`` whatever happens to the job afterwards. Only
    a rank 0 killed between creating and unlinking leaves its file: the next segment made in
    ``directory`` removes it (``remove_orphans``).

    With ``optional``, a file that cannot be made (no room) is None on every rank, for callers
    that can do without (private memory, gloo).

    collective: every rank of ``group``.

    Raises:
        DslaunchError: the file cannot be made (no room in ``directory``, no ``/dev/shm``) and
            it is not ``optional``.
    """
    directory = directory or segment_directory()
    name = [os.path.join(directory, f"dslaunch-shm-{tag}-{os.getpid()}-{uuid.uuid4().hex[:12]}")]
    if dist.get_rank(group) == 0:
        remove_orphans(directory)
        try:
            _create(name[0], size)
        except DslaunchError:
            if not optional:
                raise
            name = [""]
    try:
        dist.broadcast_object_list(name, src=0 if group is None else dist.get_global_rank(group, 0), group=group)
        if not name[0]:
            return None
        fd = os.open(name[0], os.O_RDWR)
        try:
            return mmap.mmap(fd, size)
        finally:
            os.close(fd)
    finally:
        try:
            dist.barrier(group=group)  # every rank mapped it (or failed): the name can go
        finally:  # also when the peers are gone: nothing may stay in the directory
            if dist.get_rank(group) == 0 and name[0]:
                os.unlink(name[0])


def remove_orphans(directory: str, now: float | None = None) -> list[str]:
    """Remove this user's segment files in ``directory`` whose creating process is gone and that
    are older than ``ORPHAN_AGE_S``; returns their paths."""
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:  # no directory: creating the segment says so
        return removed
    for entry in entries:
        found = _SEGMENT.fullmatch(entry.name)
        try:
            st = entry.stat(follow_symlinks=False)
            if (found and entry.is_file(follow_symlinks=False) and st.st_uid == os.getuid()
                    and now - st.st_mtime > ORPHAN_AGE_S and not _alive(int(found.group(1)))):
                os.unlink(entry.path)
                removed.append(entry.path)
        except OSError:  # gone meanwhile (a peer's job unlinked it): nothing to do
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _create(path: str, size: int) -> None:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        raise DslaunchError(f"shared-memory all-reduce: cannot create {path} ({err.strerror})") from None
    try:
        os.posix_fallocate(fd, 0, size)  # the pages now: a full /dev/shm fails here, not with SIGBUS later
    except OSError as err:
        os.unlink(path)
        raise DslaunchError(f"shared-memory segment: cannot reserve {size} bytes in {path} ({err.strerror})") from None
    finally:
        os.close(fd)
