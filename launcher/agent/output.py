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

__all__ = ["Sink", "pump", "ExceptionWatch"]


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


class ExceptionWatch:
    """Remembers the last uncaught Python exception a worker printed on stderr.

    Recognises the interpreter's traceback (``Traceback (most recent call last):``, indented
    frames, then ``Type: message``, possibly behind torch's ``[rankN]:`` prefix) and dslaunch's
    own one-line errors (``dslaunch: error: ...``). ``exception`` is the last exception as one line;
    ``traceback`` the whole report as printed, chained exceptions included (Python prints the
    original one first). The launcher names it as the cause of a failure, also when the rank then
    died by a signal (an abort during teardown), and writes it to the rank's error file.
    """

    MAX_CHARS = 300  # one readable line, whatever the script raised
    MAX_LINES = 400  # of a traceback: deep recursion prints thousands

    def __init__(self) -> None:
        self.exception: str | None = None
        self.traceback: str | None = None
        self._in_traceback = False
        self._chained = False  # "During handling of the above exception" was just printed
        self._block: list[str] = []

    def feed(self, line: bytes) -> None:
        text = _TORCH_RANK_PREFIX.sub("", line.decode("utf-8", "replace").rstrip("\r\n"))
        if text.startswith("Traceback (most recent call last):"):
            if not self._chained:
                self._block = []
            self._in_traceback, self._chained = True, False
            self._add(text)
        elif text.startswith("dslaunch: error: "):
            self._remember(text[len("dslaunch: error: "):])
            self.traceback = text
        elif self._in_traceback and text and not text[0].isspace():
            self._in_traceback = False
            self._add(text)
            self._remember(text)
            self.traceback = "\n".join(self._block)
        elif self._in_traceback:
            self._add(text)
        elif text.startswith(_CHAIN) and self._block:
            self._chained = True
            self._add("")
            self._add(text)
            self._add("")

    def _add(self, text: str) -> None:
        if len(self._block) < self.MAX_LINES:
            self._block.append(text)

    def _remember(self, text: str) -> None:
        self.exception = text if len(text) <= self.MAX_CHARS else text[:self.MAX_CHARS - 3] + "..."


_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
_TORCH_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?")


def pump(pipe: BinaryIO, prefix: bytes, sink: Sink, log: Sink | None,
         watch: ExceptionWatch | None = None) -> None:
    """Copy ``pipe`` to ``sink`` line by line with ``prefix``; also raw to ``log``. Thread target.

    A line ends at ``\n`` or at a lone ``\r``, so progress bars (tqdm) that redraw with ``\r``
    show up as they go, each redraw prefixed. A final unterminated line gets a ``\n``. torch's
    own ``[rankN]: `` mark on traceback lines (its excepthook after ``init_process_group``) is left
    out of the ``sink`` copy when it repeats ``prefix``'s rank: ``[rank1] [rank1]: `` helps nobody.
    """
    torch_mark = prefix.rstrip() + b": "
    pending = b""
    with pipe:
        while chunk := pipe.read1(65536):
            pending += chunk
            end = 0
            for m in _LINE.finditer(pending):
                if m.end() == len(pending) and pending.endswith(b"\r"):
                    break  # maybe the first half of \r\n: wait for the next chunk
                _emit(pending[m.start():m.end()], prefix, sink, log, watch, torch_mark)
                end = m.end()
            pending = pending[end:]
    if pending:
        _emit(pending if pending.endswith((b"\n", b"\r")) else pending + b"\n", prefix, sink, log, watch,
              torch_mark)


_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)")


def _emit(line: bytes, prefix: bytes, sink: Sink, log: Sink | None, watch: ExceptionWatch | None,
          torch_mark: bytes) -> None:
    sink.write(prefix + line.removeprefix(torch_mark))
    if log is not None:
        log.write(line)
    if watch is not None:
        watch.feed(line)
