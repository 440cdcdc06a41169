"""NVMe swap space of one rank: an anonymous file under ``nvme_path`` read and written by a thread pool.

No native aio extension: requests are ``os.preadv``/``os.pwritev`` calls (they release the GIL)
on a pool of ``queue_depth`` threads, each request at most ``block_size`` bytes, so up to
``queue_depth`` requests are in flight at once, as libaio's queue would hold them.

The file never has a name: it is opened with ``O_TMPFILE`` (or, on a file system without it,
created and unlinked at once). The kernel frees its blocks when the last descriptor closes,
which happens at any exit, a crash or SIGKILL included; nothing is left under ``nvme_path``.
Its size is reserved up front (``posix_fallocate``), so a disk too small fails before training.
"""

from __future__ import annotations

import os
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from dslaunch.errors import ConfigError

__all__ = ["SwapFile", "SwapSettings", "Pending", "buffer_slots"]

@dataclass(frozen=True)
class SwapSettings:
    """Where and how state is swapped (``offload_optimizer``/``offload_param`` with ``device: nvme``, ``aio``)."""

    path: str
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    pipeline_read: bool = False
    pipeline_write: bool = False
    block_size: int = 1_048_576
    queue_depth: int = 8
    section: str = "offload_optimizer"  # the config section errors name (or "offload_param")
    what: str = "optimizer state"  # what the swap space holds, for the no-space error

    @property
    def key(self) -> str:
        return f"zero_optimization.{self.section}.nvme_path"


def buffer_slots(settings: SwapSettings, wanted: int, useful: int, buffer_bytes: int) -> int:
    """How many swap buffers of ``buffer_bytes`` to keep: ``wanted`` (from ``buffer_count``), but
    never more than ``useful`` (more than the transfers of a pass are never reused), and only as
    many as host memory holds.

    Raises:
        ConfigError: the buffers would not fit in the host memory available, naming
            ``buffer_count`` and saying what they need.
    """
    import psutil

    slots = max(1, min(wanted, useful))
    need, free = slots * buffer_bytes, psutil.virtual_memory().available
    if need > free:
        raise ConfigError(f"{settings.buffer_count}: {slots} swap buffers of {buffer_bytes / 2**20:.1f} MiB need "
                          f"{need / 2**30:.1f} GiB of host memory, {free / 2**30:.1f} GiB is available; lower "
                          "buffer_count or buffer_size", key=f"zero_optimization.{settings.section}.buffer_count")
    return slots


class Pending:
    """The requests of one read or write; ``wait`` raises the first I/O error."""

    def __init__(self, futures: list[Future]):
        self._futures = futures

    @classmethod
    def all(cls, pendings: list[Pending]) -> Pending:
        """One ``Pending`` for several."""
        return cls([f for p in pendings for f in p._futures])

    def wait(self) -> None:
        for f in self._futures:
            f.result()
        self._futures = []


def _open_anonymous(directory: str, key: str) -> int:
    """A read-write file in ``directory`` that has no name (freed when closed)."""
    if not os.path.isdir(directory):
        raise ConfigError(f"{directory!r} does not exist or is not a directory; create it or name an "
                          "existing directory on the NVMe disk", key=key)
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR, 0o600)
    except OSError:
        pass  # file systems without O_TMPFILE: create, then unlink before anything is written
    name = os.path.join(directory, f".dslaunch-swap-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot create a swap file in {directory!r}: {e.strerror}", key=key) from None
    os.unlink(name)
    return fd


class SwapFile:
    """``nbytes`` of swap space of this rank, addressed by byte offset.

    Raises:
        ConfigError: ``path`` is missing or not writable, or its file system has less than
            ``nbytes`` free (naming ``nvme_path``).
    """

    def __init__(self, settings: SwapSettings, nbytes: int):
        self.settings = settings
        self.nbytes = nbytes
        path = settings.path
        self.fd = _open_anonymous(path, settings.key)
        try:
            st = os.statvfs(path)
            free = st.f_bavail * st.f_frsize
            if free < nbytes:
                raise ConfigError(f"{path!r} has {free / 2**20:.1f} MiB free, this rank needs "
                                  f"{nbytes / 2**20:.1f} MiB for its {settings.what}", key=settings.key)
            try:
                os.posix_fallocate(self.fd, 0, max(nbytes, 1))
            except OSError as e:
                raise ConfigError(f"cannot reserve {nbytes / 2**20:.1f} MiB in {path!r}: {e.strerror}",
                                  key=settings.key) from None
        except BaseException:
            os.close(self.fd)
            raise
        self._pool = ThreadPoolExecutor(max_workers=settings.queue_depth, thread_name_prefix="dsl-swap")

    def read(self, offset: int, into: torch.Tensor) -> Pending:
        """Start reading ``into.nbytes`` bytes at ``offset`` into the contiguous CPU tensor ``into``."""
        return self._submit(os.preadv, offset, into)

    def write(self, offset: int, data: torch.Tensor) -> Pending:
        """Start writing the contiguous CPU tensor ``data`` at ``offset``. ``data`` must stay
        unchanged until the returned ``Pending`` is waited for."""
        return self._submit(os.pwritev, offset, data)

    def _submit(self, call, offset: int, t: torch.Tensor) -> Pending:
        view = memoryview(t.view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
        if offset + len(view) > self.nbytes:
            raise ValueError(f"swap request [{offset}, {offset + len(view)}) beyond {self.nbytes} bytes")
        block = self.settings.block_size
        return Pending([self._pool.submit(_all, call, self.fd, view[a:a + block], offset + a)
                        for a in range(0, len(view), block)])

    def close(self) -> None:
        """Wait for requests in flight and free the space (also happens at process exit)."""
        if self.fd >= 0:
            self._pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter teardown: the kernel closes the file anyway
            pass


def _all(call, fd: int, view: memoryview, offset: int) -> None:
    """One request, repeated on a short transfer until done."""
    done = 0
    while done < len(view):
        n = call(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"swap file: {'read' if call is os.preadv else 'write'} returned {n} at "
                          f"offset {offset + done}")
        done += n
