"""The job's log directory: ``events.jsonl`` plus the error and stack files it points to.

One JSON object per line, appended and flushed as it happens, so ``dslaunch status`` can read a
running job. Every event has ``t`` (wall-clock seconds, ``time.time()``) and ``kind``; the kinds
the monitor writes:

- ``start``: job id, hosts, world size, hang_timeout, the command;
- ``ranks_up``: every rank sent its first heartbeat (``after_s`` since start);
- ``summary``: periodic progress (step, slowest rank, samples/s, loss, memory);
- ``failure``: the root cause (rank, host, cause, exit code, signal, exception, step), its
  ``fault_t`` (when it happened or was last known good) and ``detected_t`` (when the controller
  acted), and the error files written for it;
- ``stacks``: a hang's stack dump (per rank: stopped, silent, step, top frame, file) and the ranks
  blamed;
- ``end``: exit code and duration.

Anyone may add kinds with ``emit`` (e.g. a restart loop: ``restart``, ``resume``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from dslaunch.errors import LaunchError

__all__ = ["EventLog", "read_events", "EVENTS_FILE"]

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``<directory>/events.jsonl``; ``directory=None`` keeps them in memory only.

    ``echo``: called with each event as it is recorded (the CLI prints the ones the user should
    see as lines on stderr: ``loop.print_event``).

    Raises:
        LaunchError: the directory cannot be created or written (names ``--log_dir``).
    """

    def __init__(self, directory: str | None, echo: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.directory = directory
        self._echo = echo
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._file = None
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
                self._file = open(os.path.join(directory, EVENTS_FILE), "a", encoding="utf-8")
            except OSError as err:
                raise LaunchError(f"--log_dir: cannot write {err.filename or directory}: {err.strerror}") from None

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event now; returns it. Thread-safe; a full disk never fails the job."""
        event = {"t": round(time.time(), 3), "kind": kind, **fields}
        with self._lock:
            self.events.append(event)
            if self._file is not None:
                try:
                    self._file.write(json.dumps(event, separators=(",", ":"), default=str) + "\n")
                    self._file.flush()
                except OSError:
                    pass
        if self._echo is not None:
            self._echo(event)
        return event

    def write_file(self, name: str, text: str) -> str | None:
        """Write ``text`` to ``<directory>/name``; its path, or None (no directory, or an error)."""
        if self.directory is None:
            return None
        path = os.path.join(self.directory, name)
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError:
            return None
        return path

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict[str, Any]]:
    """The events of an ``events.jsonl`` file; a torn last line (a job still writing) is skipped."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "kind" in event:
                out.append(event)
    return out
