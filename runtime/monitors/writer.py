"""One background thread that writes a monitor's events, so the training thread only enqueues.

``BackgroundWriter(write, flush)`` calls ``write(batch)`` for each ``put(batch)`` in order on its own
daemon thread, then ``flush()``. The thread wakes at most once per ``interval`` seconds and writes
everything queued by then: a put never hands the GIL to a thread that would write at once, and
files are flushed once per interval, not per step (a killed run loses at most the last interval's
events). ``flush()`` and ``close()`` on the writer wait for what was queued before them, and cut the
interval short (the engine flushes before each checkpoint save: a resume from that checkpoint
then finds every event up to it on disk). A failing write (disk full, a service gone) prints one warning line and stops
the writer: monitoring must never stop training.
"""

from __future__ import annotations

import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BackgroundWriter"]

_STOP = object()


class BackgroundWriter:
    """Ordered writes on a daemon thread.

    Args:
        write: called with each batch (on the writer thread).
        flush: called when the queue is empty after a write, and by ``flush()``.
        name: the thread's name (and the warning's prefix).
        interval: seconds the thread sleeps after waking, to collect what the run queues meanwhile.
    """

    def __init__(self, write: Callable[[Any], None], flush: Callable[[], None], name: str = "dslaunch-monitor",
                 interval: float = 0.5):
        self._write, self._flush, self.name, self.interval = write, flush, name, interval
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: str | None = None
        self._wake = threading.Event()  # set by flush/close: write now, not after the interval
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, batch: Any) -> None:
        """Queue ``batch`` (never blocks; dropped once the writer has failed)."""
        if self.failed is None:
            self._queue.put(batch)

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Block until everything queued so far is written and flushed; False on timeout."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.put(done)
        self._wake.set()
        return done.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        """Write what is queued, flush, and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._wake.set()
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            items = [self._queue.get()]
            self._wake.wait(self.interval)  # not a timed get: each put would wake it
            self._wake.clear()
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is _STOP:
                    self._guarded(self._flush)
                    return
                if isinstance(item, threading.Event):
                    self._guarded(self._flush)
                    item.set()
                elif self.failed is None:
                    self._guarded(self._write, item)
            self._guarded(self._flush)

    def _guarded(self, fn: Callable[..., None], *args: Any) -> None:
        if self.failed is not None:
            return
        try:
            fn(*args)
        except Exception as err:  # report once, keep training
            self.failed = f"{type(err).__name__}: {err}"
            print(f"dslaunch: warning: {self.name}: {self.failed}; this monitor writes nothing more",
                  file=sys.stderr, flush=True)
