"""Worker output: copy each worker's stdout/stderr line by line, prefixed with its rank.

stdout lines go to the agent's stdout and stderr lines to its stderr (kept apart), each line
written whole with one locked write so ranks never interleave inside a line. With
``--enable_each_rank_log`` each rank's lines (both streams, unprefixed) also go to one file.
"""

from __future__ import annotations

import os
import re
import threading
from typing import BinaryIO

__all__ = ["Sink", "pump"]


class Sink:
    """A file descriptor shared by several pump threads; writes whole buffers under a lock."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._broken:
                return
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(self.fd, view):]
            except OSError:  # reader went away (EPIPE): keep draining the workers, drop output
                self._broken = True

    def close(self) -> None:
        with self._lock:
            self._broken = True
            os.close(self.fd)


def pump(pipe: BinaryIO, prefix: bytes, sink: Sink, log: Sink | None) -> None:
    """Copy ``pipe`` to ``sink`` line by line with ``prefix``; also raw to ``log``. Thread target.

    A line ends at ``\n`` or at a lone ``\r``, so progress bars (tqdm) that redraw with ``\r``
    show up as they go, each redraw prefixed. A final unterminated line gets a ``\n``.
    """
    pending = b""
    with pipe:
        while chunk := pipe.read1(65536):
            pending += chunk
            end = 0
            for m in _LINE.finditer(pending):
                if m.end() == len(pending) and pending.endswith(b"\r"):
                    break  # maybe the first half of \r\n: wait for the next chunk
                _emit(pending[m.start():m.end()], prefix, sink, log)
                end = m.end()
            pending = pending[end:]
    if pending:
        _emit(pending if pending.endswith((b"\n", b"\r")) else pending + b"\n", prefix, sink, log)


_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def _emit(line: bytes, prefix: bytes, sink: Sink, log: Sink | None) -> None:
    sink.write(prefix + line)
    if log is not None:
        log.write(line)
