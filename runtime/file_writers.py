"""DeepNVMe's file writers (DeepSpeed's ``deepspeed.io``): file-like objects ``torch.save`` writes into.

``torch.save(obj, f=writer)``, then ``writer.close()``: the bytes are those ``torch.save`` writes to a
plain file. Each writer writes through ``dslaunch.safe_write.atomic_file``: into a new temporary
file beside ``file_path``, renamed onto it only by ``close()``. A save that fails (``torch.save``
raises, the process dies) leaves the old file as it was and no half-written file under the name;
a writer used as a context manager (``with PyFileWriter(p) as w:``) discards the temporary file
when the block raises, and one dropped without ``close()`` discards it when collected.

- ``PyFileWriter(file_path)``: buffered Python writes.
- ``FastFileWriter(file_path, config)``: ``config`` a ``FastFileWriterConfig`` (``dnvme_handle``,
  ``pinned_tensor``, ``double_buffer``, ``num_parallel_writers``, ``writer_rank``,
  ``global_rank``): bytes are staged through ``pinned_tensor`` (a uint8 host tensor) and each full
  buffer goes to the file in one write; ``dnvme_handle`` is accepted as given and not used.
- ``MockFileWriter(file_path)``: writes nothing but counts, as DeepSpeed's (the file it opens stays
  empty: DeepSpeed's creates it too).

Statistics: ``_stats`` / ``file_stats()`` (DeepSpeed's keys: ``close``, ``fileno``, ``flush``,
``write``, ``bytes``, ``write_secs``, ``write_GB/s``, ``path``), ``_dump_state()`` prints them.

Limitations: DeepSpeed's O_DIRECT asynchronous I/O (``aio_handle``, GPUDirect Storage) is not used:
writes are ordinary ones. ``save_torch_storage_object_list`` (the path of DeepSpeed's own
checkpoint engine) and parallel writers splitting one file are not implemented.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.safe_write import atomic_file, split_path

__all__ = ["BaseFileWriter", "PyFileWriter", "FastFileWriter", "FastFileWriterConfig", "MockFileWriter"]

INVALID_FD = -1


class _Discarded(Exception):
    """Thrown into ``atomic_file`` to make it drop its temporary file."""

_BASE_KEYS = ("close", "fileno", "flush", "write", "bytes", "write_secs", "write_GB/s")
_FAST_KEYS = ("aio_write_secs", "aio_bytes", "aio_GB/s", "slow_bytes", "slow_write_secs", "fill_buffer_secs",
              "fill_buffer_count", "fill_buffer_GB/s", "save_storage", "save_storage_bytes")


class BaseFileWriter:
    """A write-only binary file that appears at ``file_path`` when closed (module docstring)."""

    _extra_keys: tuple[str, ...] = ()
    _durable = False  # fsync before the rename (DeepSpeed's FastFileWriter fsyncs)

    def __init__(self, file_path: str | os.PathLike[str]):
        self._file_path = os.fspath(file_path)
        self._stats: dict[str, Any] = {k: 0 for k in (*_BASE_KEYS, *self._extra_keys)}
        self._pending: contextlib.ExitStack | None = contextlib.ExitStack()
        self._fp = self._pending.enter_context(atomic_file(*split_path(self._file_path), mode=0o644,
                                                               durable=self._durable))

    def write(self, buffer: Any) -> int:
        """Append ``buffer`` (bytes-like); returns its length."""
        started = time.time()
        n = self._put(memoryview(buffer).cast("B"))
        self._count(n, time.time() - started)
        return n

    def _put(self, data: memoryview) -> int:
        return self._fp.write(data)

    def _count(self, n: int, secs: float) -> None:
        self._stats["write"] += 1
        self._stats["bytes"] += n
        self._stats["write_secs"] += secs

    def flush(self) -> None:
        self._stats["flush"] += 1

    def fileno(self) -> int:
        """DeepSpeed's writers return -1: ``torch.save`` then writes through ``write``."""
        self._stats["fileno"] += 1
        return INVALID_FD

    def file_path(self) -> str:
        return self._file_path

    def close(self) -> None:
        """Finish the file and rename it onto ``file_path`` (the old file is replaced only now)."""
        if self._pending is None:
            return
        self._drain()
        self._stats["close"] += 1
        pending, self._pending = self._pending, None
        pending.close()

    def _drain(self) -> None:
        """Write what is staged (``FastFileWriter``)."""

    def _discard(self) -> None:
        """Drop the temporary file: ``file_path`` keeps what it had."""
        pending, self._pending = self._pending, None
        if pending is not None:
            with contextlib.suppress(_Discarded):  # atomic_file removes its file, then re-raises it
                pending.__exit__(_Discarded, _Discarded(), None)

    def __enter__(self) -> BaseFileWriter:
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if kind is None:
            self.close()
        else:
            self._discard()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._discard()

    def file_stats(self) -> dict[str, Any]:
        """The counters (DeepSpeed's keys), with ``write_GB/s`` and ``path``."""
        if self._stats["write_secs"] > 0:
            self._stats["write_GB/s"] = self._stats["bytes"] / self._stats["write_secs"] / 1024**3
        return {**self._stats, "path": self._file_path}

    def _dump_state(self) -> None:
        """Print the statistics (DeepSpeed's name)."""
        print(f"stats = {self.file_stats()}")


class PyFileWriter(BaseFileWriter):
    """Python's buffered writes (DeepSpeed's ``PyFileWriter``)."""


class MockFileWriter(BaseFileWriter):
    """Counts what would be written and writes nothing (DeepSpeed's ``MockFileWriter``)."""

    _extra_keys = ("save_storage", "save_storage_bytes")

    def _put(self, data: memoryview) -> int:
        return len(data)


@dataclass
class FastFileWriterConfig:
    """DeepSpeed's ``FastFileWriterConfig``: ``pinned_tensor`` is the staging buffer (uint8);
    ``dnvme_handle`` (an ``aio_handle``), ``double_buffer`` and the parallel-writer fields are
    kept as given."""

    dnvme_handle: object
    pinned_tensor: torch.Tensor
    double_buffer: bool = True
    num_parallel_writers: int = 1
    writer_rank: int = 0
    global_rank: int = 0


class FastFileWriter(BaseFileWriter):
    """Bytes staged in ``config.pinned_tensor``, each full buffer written at once (DeepSpeed's
    ``FastFileWriter``, without its O_DIRECT asynchronous I/O)."""

    _extra_keys = _FAST_KEYS
    _durable = True

    def __init__(self, file_path: str | os.PathLike[str], config: FastFileWriterConfig):
        buf = config.pinned_tensor
        if not torch.is_tensor(buf) or buf.dtype != torch.uint8 or buf.device.type != "cpu" or buf.numel() == 0:
            raise ValueError("FastFileWriterConfig.pinned_tensor: expected a non-empty uint8 host tensor, got "
                             f"{getattr(buf, 'dtype', type(buf).__name__)} on {getattr(buf, 'device', '?')}")
        self._config = config
        self._staged = memoryview(buf.numpy()).cast("B")  # the tensor's memory: writes land in it
        self._offset = 0
        super().__init__(file_path)

    def _put(self, data: memoryview) -> int:
        at = 0
        while at < len(data):
            n = min(len(data) - at, len(self._staged) - self._offset)
            started = time.time()
            self._staged[self._offset:self._offset + n] = data[at:at + n]
            self._stats["fill_buffer_secs"] += time.time() - started
            self._stats["fill_buffer_count"] += 1
            self._offset += n
            at += n
            if self._offset == len(self._staged):
                self._drain()
        return at

    def _drain(self) -> None:
        if self._offset == 0:
            return
        started = time.time()
        self._fp.write(self._staged[:self._offset])
        self._stats["aio_write_secs"] += time.time() - started
        self._stats["aio_bytes"] += self._offset
        self._offset = 0

    def file_stats(self) -> dict[str, Any]:
        if self._stats["aio_write_secs"] > 0:
            self._stats["aio_GB/s"] = self._stats["aio_bytes"] / self._stats["aio_write_secs"] / 1024**3
        return super().file_stats()
