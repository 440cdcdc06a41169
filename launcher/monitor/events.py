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
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from dslaunch.errors import LaunchError, shorten
from dslaunch.launcher.monitor.logdir import open_append, open_job_dir, replace_file, write_all

__all__ = ["EventLog", "read_events", "EVENTS_FILE"]

EVENTS_FILE = "events.jsonl"


class EventLog:
    """Appends events to ``<directory>/events.jsonl``; ``directory=None`` keeps them in memory only.

    The directory is made fresh and its files are written without following links (see
    ``logdir``). Once the log exists, writing it never fails the job: the first failed write
    (a full disk) is said once on stderr, and the job's exit code stays the job's.

    ``echo``: called with each event as it is recorded (the CLI prints the ones the user should
    see as lines on stderr: ``loop.print_event``).

    Raises:
        LaunchError: the directory is refused or cannot be created (names ``--log_dir``).
    """

    def __init__(self, directory: str | None, echo: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.directory = directory
        self._echo = echo
        self.events: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._dir_fd: int | None = None
        self._fd: int | None = None
        self._torn = False  # a line was cut short: the next one starts on a line of its own
        self._failed = False
        if directory is not None:
            self._dir_fd = open_job_dir(directory)
            try:
                self._fd = open_append(self._dir_fd, EVENTS_FILE)
            except OSError as err:
                os.close(self._dir_fd)
                raise LaunchError(f"--log_dir: cannot create {shorten(os.path.join(directory, EVENTS_FILE), 300)}: "
                                  f"{err.strerror}") from None

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event now; returns it. Thread-safe; a full disk never fails the job."""
        event = {"t": round(time.time(), 3), "kind": kind, **fields}
        with self._lock:
            self.events.append(event)
            if self._fd is not None:
                line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
                self._append(("\n" if self._torn else "") + line)
        if self._echo is not None:
            self._echo(event)
        return event

    def _append(self, line: str) -> None:
        assert self._fd is not None
        data = line.encode("utf-8", "backslashreplace")  # a lone surrogate in a path or argv
        try:
            write_all(self._fd, data)
            self._torn = False
        except OSError as err:
            self._torn = True  # perhaps part of it went out (readers skip the empty line otherwise)
            self._report(err, EVENTS_FILE)

    def write_file(self, name: str, text: str) -> str | None:
        """``<directory>/name`` holds ``text``; its path, or None (no directory, or a failed
        write, said once: nothing is left behind)."""
        with self._lock:
            if self._dir_fd is None or self.directory is None:
                return None
            try:
                replace_file(self._dir_fd, name, text.encode("utf-8", "backslashreplace"))
            except OSError as err:
                self._report(err, name)
                return None
        return os.path.join(self.directory, name)

    def _report(self, err: OSError, name: str) -> None:
        """The first failed write, once on stderr; the job goes on and keeps its exit code."""
        if self._failed:
            return
        self._failed = True
        try:
            print(f"dslaunch: warning: cannot write {name} in {shorten(str(self.directory), 300)}: "
                  f"{err.strerror}; the job goes on, its exit code unchanged (further log errors are not "
                  "shown)", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # stderr closed too: nothing left to tell
            pass

    def close(self) -> None:
        """Close the log; never raises (everything was written, or said, already)."""
        with self._lock:
            for fd in (self._fd, self._dir_fd):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            self._fd = self._dir_fd = None


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
