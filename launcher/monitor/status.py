"""How the job's state reads for a person: the live status line and ``dslaunch status``.

- ``StatusLine``: on the controller's terminal, one line redrawn every second when stderr is a
  TTY (step, samples/s, tokens/s, MFU, slowest rank, memory); when it is not (a log file, CI), a plain line
  every ``PLAIN_EVERY_S`` seconds, so logs stay readable;
- ``describe_job``: a finished or running job summarised from its ``events.jsonl``, root cause
  first.
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter, deque
from collections.abc import Iterable
from typing import Any

from dslaunch.errors import quote, shorten
from dslaunch.launcher.agent.procs import proc_stat

__all__ = ["StatusLine", "JobStory", "format_progress", "describe_job", "controller_gone", "process_start_ticks",
           "PLAIN_EVERY_S", "SHOWN_EACH"]

PLAIN_EVERY_S = 30.0
_TTY_EVERY_S = 1.0
_GIB = 1024 ** 3


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / _GIB:.1f}"


def format_progress(summary: dict[str, Any]) -> str:
    """``step 120 | 35.2 samples/s | 9011 tokens/s | MFU 41.3% (6N*tokens) | loss 0.41 | slowest rank 1
    (step 118) | GPU 1.2/80.0 GiB (peak 2.1) | memory checkpoint step 115 (3.0 GiB on 2 host(s))``."""
    if not summary.get("ranks_up"):
        return f"waiting for ranks (0/{summary.get('world', '?')} up)"
    parts = [f"step {summary['step']}" if summary.get("step") is not None else "before step 1"]
    if summary.get("samples_per_s") is not None:
        parts.append(f"{summary['samples_per_s']:.1f} samples/s")
    if summary.get("tokens_per_s") is not None:
        parts.append(f"{summary['tokens_per_s']:.0f} tokens/s")
    if summary.get("mfu") is not None:
        parts.append(f"MFU {100 * summary['mfu']:.1f}% ({_text(summary.get('mfu_from') or '?', 20)})")
    if summary.get("loss") is not None:
        parts.append(f"loss {summary['loss']:.4g}")
    if summary.get("ranks_up") != summary.get("world"):
        parts.append(f"{summary['ranks_up']}/{summary.get('world', '?')} ranks up")
    elif summary.get("lagging"):
        parts.append(f"slowest rank {summary.get('slowest_rank')} (step {summary.get('slowest_step')})")
    mem = summary.get("memory")
    if mem:
        what = "GPU" if mem.get("kind") == "gpu" else "RSS"
        total = f"/{_gib(mem.get('total'))}" if mem.get("total") else ""
        parts.append(f"{what} {_gib(mem.get('used'))}{total} GiB (peak {_gib(mem.get('peak'))})")
    held = summary.get("memory_checkpoint")
    if isinstance(held, dict) and held:  # host -> newest complete snapshot's step, bytes its store holds
        steps = [v.get("step") for v in held.values() if isinstance(v, dict) and isinstance(v.get("step"), int)]
        size = sum(v.get("bytes") or 0 for v in held.values() if isinstance(v, dict))
        parts.append(f"memory checkpoint step {min(steps) if steps else '-'} ({_gib(size)} GiB on "
                     f"{len(held)} host(s))")
    return " | ".join(parts)


class StatusLine:
    """The controller's live status on ``fd`` (stderr). Call ``show`` often; it rate-limits."""

    def __init__(self, fd: int = 2) -> None:
        self._fd = fd
        self._tty = os.isatty(fd)
        self._last = 0.0 if self._tty else time.monotonic()  # a plain line only after a while
        self._drawn = False

    def show(self, summary: dict[str, Any], now: float | None = None) -> None:
        if not summary.get("ranks_up"):
            return  # scripts without heartbeats: nothing to say, say nothing
        now = time.monotonic() if now is None else now
        if now - self._last < (_TTY_EVERY_S if self._tty else PLAIN_EVERY_S):
            return
        self._last = now
        text = format_progress(summary)
        # On a TTY: drawn at column 0 and the cursor put back there, so the workers' next line
        # overwrites it instead of being glued to it.
        self._write(f"\x1b[2K{text}\r" if self._tty else f"dslaunch: {text}\n")
        self._drawn = self._tty

    def clear(self) -> None:
        if self._drawn:
            self._write("\x1b[2K\r")
            self._drawn = False

    def _write(self, text: str) -> None:
        try:
            os.write(self._fd, text.encode())
        except OSError:
            pass


SHOWN_EACH = 20
"""``dslaunch status`` shows at most this many failures, hangs and other events (the last ones),
and this many ranks of a hang: a log of 200,000 notes is still a page."""
_TEXT = 300
"""The most characters of one shown line; event text is the job's, of any length."""


class JobStory:
    """What ``dslaunch status`` tells of a job, gathered from its events in one pass and bounded
    in memory and output whatever the log holds. ``add`` each item of ``events.read_events``."""

    def __init__(self) -> None:
        self.start: dict[str, Any] | None = None
        self.end: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self.last_t: float | None = None
        self.events = 0
        self.skipped = 0
        self.failures: deque[dict[str, Any]] = deque(maxlen=SHOWN_EACH)
        self.stacks: deque[dict[str, Any]] = deque(maxlen=SHOWN_EACH)
        self.others: deque[dict[str, Any]] = deque(maxlen=SHOWN_EACH)
        self.unshown = Counter[str]()  # kind -> events left out of the deques above

    def add(self, event: dict[str, Any] | None) -> None:
        if event is None:
            self.skipped += 1
            return
        self.events += 1
        self.last_t = event["t"]
        kind = event["kind"]
        if kind == "start":
            self.start = self.start or event  # the job's; a restart loop's runs add no start
        elif kind == "end":
            self.end = event
        elif kind == "summary":
            self.summary = event
        elif kind != "ranks_up":
            shown = {"failure": self.failures, "stacks": self.stacks}.get(kind, self.others)
            if len(shown) == shown.maxlen:
                self.unshown["failures" if kind == "failure" else "hangs" if kind == "stacks" else "events"] += 1
            shown.append(event)

    def describe(self, now: float | None = None) -> str:
        """The story: state, progress, root cause first, stacks, other events, what was left out."""
        now = time.time() if now is None else now
        start = self.start or {}
        lines = [f"job {start.get('job_id', '?')}: {len(start.get('hosts', []))} host(s), "
                 f"world size {start.get('world_size', '?')}"]
        lines.append(self._state(now))
        if self.summary is not None:
            lines.append(f"progress: {format_progress(self.summary)}")
        for failure in self.failures:
            lines.extend(_failure(failure))
        for stacks in self.stacks:
            lines.extend(_hang(stacks))
        for other in self.others:
            fields = [f"{_text(k, 40)}={quote(v, 120)}" for k, v in list(other.items())[:10] if k not in ("t", "kind")]
            lines.append(f"{_text(other['kind'], 40)}: {', '.join(fields)}")
        for what, n in sorted(self.unshown.items()):
            lines.append(f"({n} earlier {what} not shown)")
        if self.skipped:
            lines.append(f"({self.skipped} line(s) skipped: not valid events)")
        return "\n".join(_text(line, _TEXT) for line in lines)

    def _state(self, now: float) -> str:
        if self.end is not None:
            duration = self.end.get("duration_s")
            after = f" after {duration:.1f} s" if duration is not None else ""
            return f"state: finished, exit code {self.end.get('exit_code')}{after}"
        if self.start is None:
            return "state: unknown (no start event: not a dslaunch log, or its start was lost)"
        ago = f"last event {now - (self.last_t or now):.0f} s ago"
        if controller_gone(self.start):
            return (f"state: ended without a word ({ago}): its controller, pid {self.start['pid']}, is gone "
                    "(killed with SIGKILL, or the machine restarted)")
        return f"state: running ({ago})"


def controller_gone(start: dict[str, Any]) -> bool:
    """Whether the controller that wrote ``start`` is known to be gone: it ran on this host and its
    pid no longer names that process (same pid, same start time). Elsewhere, or without ``/proc``,
    it cannot be told from here: not gone."""
    pid, started = start.get("pid"), start.get("pid_start_ticks")
    if not isinstance(pid, int) or started is None or start.get("host") != socket.gethostname():
        return False
    return process_start_ticks(pid) != started  # None: no such process; another value: a reused pid


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/PID/stat``, field 22), or
    None when there is no such process. Read directly, not through psutil: the controller imports
    neither psutil nor torch, to start fast."""
    fields = proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def _failure(failure: dict[str, Any]) -> list[str]:
    lines = [f"root cause: {_text(failure.get('message'))}"]
    if failure.get("detected_t") is not None and failure.get("fault_t") is not None:
        lines.append(f"  detected {failure['detected_t'] - failure['fault_t']:.2f} s after the fault")
    if failure.get("remedy"):
        lines.append(f"  {_text(failure['remedy'])}")
    files, more_files = _bounded(failure.get("error_files", []), "error files")
    others, more_others = _bounded(failure.get("others", []), "failures")
    lines.extend(f"  error file: {_text(path)}" for path in files)
    lines.extend(f"  then: {_text(other)}" for other in others)
    return lines + [note for note in (more_files, more_others) if note]


def _hang(stacks: dict[str, Any]) -> list[str]:
    lines = [f"hang: ranks behind: {_text(', '.join(map(str, stacks.get('behind', []))))}"]
    ranks, more = _bounded(sorted(stacks.get("ranks", {}).items(), key=lambda kv: int(kv[0])), "ranks")
    for rank, info in ranks:
        state = "stopped" if info.get("stopped") else "silent" if info.get("silent") else "running"
        where = f" [{_text(info['file'])}]" if info.get("file") else ""
        lines.append(f"  rank {rank} ({state}, step {info.get('step')}): {_text(info.get('top_frame') or 'no stack')}"
                     f"{where}")
    return lines + ([more] if more else [])


def _bounded(items: list[Any], what: str) -> tuple[list[Any], str | None]:
    """The first ``SHOWN_EACH`` of ``items``, and a note on how many more there are (or None)."""
    more = len(items) - SHOWN_EACH
    return (items, None) if more <= 0 else (items[:SHOWN_EACH], f"  ... and {more} more {what}")


def _text(value: Any, limit: int = _TEXT) -> str:
    """Text from the log for the terminal: on one line, control characters escaped (no escape
    sequence of the job's reaches the terminal), at most ``limit`` characters."""
    return shorten(str(value), limit)


def describe_job(events: Iterable[dict[str, Any] | None], now: float | None = None) -> str:
    """A job's story from its events (None: a line that was no valid event)."""
    story = JobStory()
    for event in events:
        story.add(event)
    return story.describe(now)
