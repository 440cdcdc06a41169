"""The job's log directory: ``events.jsonl`` plus the error and stack files it points to.

One JSON object per line, appended and flushed as it happens, so ``dslaunch status`` can read a
running job. Every event has ``t`` (wall-clock seconds, ``time.time()``) and ``kind``; the kinds
the monitor writes:

- ``start``: job id, hosts, world size, hang_timeout, the command;
- ``ranks_up``: every rank sent its first heartbeat (``after_s`` since start);
- ``summary``: periodic progress (step, slowest rank, samples/s, tokens/s, MFU, loss, memory);
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
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from dslaunch.errors import LaunchError, shorten
from dslaunch.launcher.monitor.logdir import open_job_dir, replace_file
from dslaunch.safe_write import create_new, write_all

__all__ = ["EventLog", "read_events", "valid_event", "EVENTS_FILE", "MAX_LINE_BYTES"]

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
                self._fd = create_new(self._dir_fd, EVENTS_FILE)
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


MAX_LINE_BYTES = 1 << 20
"""A longer line of ``events.jsonl`` is not an event (the longest the monitor writes, a hang's
stacks summary of a large job, is far shorter): readers skip it without holding it."""


def read_events(f: BinaryIO) -> Iterator[dict[str, Any] | None]:
    """The events of an open ``events.jsonl``, one item per line: the event, or None for a line
    that is no valid event (not UTF-8 JSON, too long or deep, a field of the wrong type; see
    ``valid_event``). A torn last line (a job still writing) and empty lines are left out.

    Raises:
        OSError: reading failed.
    """
    while line := f.readline(MAX_LINE_BYTES):
        if not line.endswith(b"\n"):
            if len(line) < MAX_LINE_BYTES:
                return  # the last line, still being written
            while (rest := f.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                pass  # the rest of an overlong line
            yield None
            continue
        if line.strip():
            yield _parse(line)


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        event = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # also bad UTF-8 (UTF-16 too), a 5000-digit number
        return None
    return event if valid_event(event) else None


_Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    """An int (not bool) a float can hold: status divides and subtracts them."""
    return isinstance(v, int) and not isinstance(v, bool) and -2 ** 63 <= v < 2 ** 63


def _num(v: Any) -> bool:
    return _int(v) or (isinstance(v, float) and math.isfinite(v))


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _rank_key(v: Any) -> bool:
    return isinstance(v, str) and v.isascii() and v.isdigit() and len(v) < 10


def _opt(check: _Check) -> _Check:
    return lambda v: v is None or check(v)


def _list(check: _Check) -> _Check:
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _fields(schema: dict[str, _Check]) -> _Check:
    """A dict whose fields named in ``schema`` (each may be missing) pass their check."""
    return lambda v: isinstance(v, dict) and all(k not in v or check(v[k]) for k, check in schema.items())


def _ranks(v: Any) -> bool:
    """A hang's ``ranks``: rank number (as a string) -> what its stack showed."""
    return isinstance(v, dict) and all(_rank_key(k) and _STACK(info) for k, info in v.items())


_MEMORY = _fields({"kind": _str, "used": _int, "peak": _int, "total": _opt(_int)})
_STACK = _fields({"host": _opt(_str), "step": _opt(_int), "top_frame": _opt(_str), "file": _opt(_str)})
_KINDS: dict[str, _Check] = {
    "start": _fields({"job_id": _opt(_str), "hosts": _list(_str), "world_size": _opt(_int), "pid": _opt(_int),
                      "host": _opt(_str), "pid_start_ticks": _opt(_int)}),
    "end": _fields({"exit_code": _opt(_int), "duration_s": _opt(_num)}),
    "summary": _fields({"step": _opt(_int), "samples_per_s": _opt(_num), "loss": _opt(_num),
                        "ranks_up": _opt(_int), "world": _opt(_int), "slowest_rank": _opt(_int),
                        "slowest_step": _opt(_int), "memory": _opt(_MEMORY), "tokens_per_s": _opt(_num),
                        "mfu": _opt(_num), "mfu_from": _opt(_str)}),
    "failure": _fields({"message": _opt(_str), "fault_t": _opt(_num), "detected_t": _opt(_num),
                        "remedy": _opt(_str), "error_files": _list(_str), "others": _list(_str)}),
    "stacks": _fields({"behind": _list(_int), "ranks": _ranks}),
}
"""What readers rely on in each kind the monitor writes (other kinds: only ``t`` and ``kind``)."""


def valid_event(event: Any) -> bool:
    """Whether ``event`` is an event: a dict with a finite ``t``, a string ``kind``, and the
    fields its kind has (those present) of the right types."""
    return (isinstance(event, dict) and _num(event.get("t")) and _str(event.get("kind"))
            and _KINDS.get(event["kind"], _fields({}))(event))
