"""``disable_python_gc`` (DeepSpeed 0.19's key): Python's cyclic garbage collector off while engines
that asked for it live, for steps without its pauses (a full collection over a large model's
objects takes tens to hundreds of milliseconds, at moments no rank chooses, so ranks wait on each
other's pauses at the next collective).

The collector's switch is one per process, so the engines that asked share one count
(``PythonGC``): the first one collects once and turns automatic collection off, the last one to be
destroyed turns it back on if it was on before. ``engine.collect_python_gc()`` runs a collection at
a moment the script picks (every N steps, between epochs), leaving the switch as it is. A forked
child starts with the parent's switch but no engine: it gets automatic collection back.
"""

from __future__ import annotations

import gc
import os
import threading

from dslaunch.utils.logging import logger

__all__ = ["PythonGC", "PYTHON_GC"]


class PythonGC:
    """The count of live engines that turned automatic collection off, and what to restore."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines = 0
        self._was_enabled = False
        self._epoch = 0  # a fork starts a new one: handles from before it no longer count
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(before=self._lock.acquire, after_in_parent=self._lock.release,
                                after_in_child=self._forked)

    def _forked(self) -> None:
        if self._engines and self._was_enabled:
            gc.enable()
        self._engines, self._was_enabled, self._epoch = 0, False, self._epoch + 1
        self._lock = threading.Lock()

    def acquire(self) -> int:
        """One more engine wants automatic collection off; returns its handle for ``release``."""
        with self._lock:
            if self._engines == 0:
                self._was_enabled = gc.isenabled()
                if self._was_enabled:
                    found = gc.collect()
                    gc.disable()
                    logger.info("disable_python_gc: automatic cyclic garbage collection off (collected %d objects "
                                "first); engine.collect_python_gc() collects when you choose", found)
            self._engines += 1
            return self._epoch

    def release(self, handle: int) -> None:
        """That engine is gone; the last one turns collection back on if it was on before."""
        with self._lock:
            if handle != self._epoch or self._engines == 0:
                return
            self._engines -= 1
            if self._engines == 0 and self._was_enabled:
                self._was_enabled = False
                gc.enable()

    @staticmethod
    def collect() -> int:
        """One full collection now; the automatic switch stays as it is. Returns what it found."""
        return gc.collect()

    @property
    def engines(self) -> int:
        with self._lock:
            return self._engines


# Process-wide on purpose: the collector's switch is the process's, so is the count of its holders.
PYTHON_GC = PythonGC()
