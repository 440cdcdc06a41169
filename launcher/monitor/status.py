"""How the job's state reads for a person: the live status line and ``dslaunch status``.

- ``StatusLine``: on the controller's terminal, one line redrawn every second when stderr is a
  TTY (step, samples/s, slowest rank, memory); when it is not (a log file, CI), a plain line
  every ``PLAIN_EVERY_S`` seconds, so logs stay readable;
- ``describe_job``: a finished or running job summarised from its ``events.jsonl``, root cause
  first.
"""

from __future__ import annotations

import os
import time
from typing import Any

__all__ = ["StatusLine", "format_progress", "describe_job", "PLAIN_EVERY_S"]

PLAIN_EVERY_S = 30.0
_TTY_EVERY_S = 1.0
_GIB = 1024 ** 3


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / _GIB:.1f}"


def format_progress(summary: dict[str, Any]) -> str:
    """``step 120 | 35.2 samples/s | loss 0.41 | slowest rank 1 (step 118) | mem 1.2/80.0 GiB (peak 2.1)``."""
    if not summary.get("ranks_up"):
        return f"waiting for ranks (0/{summary.get('world', '?')} up)"
    parts = [f"step {summary['step']}" if summary.get("step") is not None else "before step 1"]
    if summary.get("samples_per_s") is not None:
        parts.append(f"{summary['samples_per_s']:.1f} samples/s")
    if summary.get("loss") is not None:
        parts.append(f"loss {summary['loss']:.4g}")
    if summary.get("ranks_up") != summary.get("world"):
        parts.append(f"{summary['ranks_up']}/{summary['world']} ranks up")
    elif summary.get("lagging"):
        parts.append(f"slowest rank {summary['slowest_rank']} (step {summary['slowest_step']})")
    mem = summary.get("memory")
    if mem:
        what = "GPU" if mem["kind"] == "gpu" else "RSS"
        total = f"/{_gib(mem.get('total'))}" if mem.get("total") else ""
        parts.append(f"{what} {_gib(mem['used'])}{total} GiB (peak {_gib(mem['peak'])})")
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


def describe_job(events: list[dict[str, Any]]) -> str:
    """A job's story from its events: state, progress, root cause first, stacks, files."""
    start = next((e for e in events if e["kind"] == "start"), {})
    end = next((e for e in reversed(events) if e["kind"] == "end"), None)
    last = events[-1]["t"] if events else time.time()
    lines = [f"job {start.get('job_id', '?')}: {len(start.get('hosts', []))} host(s), "
             f"world size {start.get('world_size', '?')}"]
    if end is None:
        lines.append(f"state: running (last event {time.time() - last:.0f} s ago)")
    else:
        lines.append(f"state: finished, exit code {end.get('exit_code')} after {end.get('duration_s', 0):.1f} s")
    summary = next((e for e in reversed(events) if e["kind"] == "summary"), None)
    if summary is not None:
        lines.append(f"progress: {format_progress(summary)}")
    for failure in (e for e in events if e["kind"] == "failure"):
        lines.append(f"root cause: {failure.get('message')}")
        if failure.get("detected_t") and failure.get("fault_t"):
            lines.append(f"  detected {failure['detected_t'] - failure['fault_t']:.2f} s after the fault")
        if failure.get("remedy"):
            lines.append(f"  {failure['remedy']}")
        for path in failure.get("error_files", []):
            lines.append(f"  error file: {path}")
        for other in failure.get("others", []):
            lines.append(f"  then: {other}")
    for stacks in (e for e in events if e["kind"] == "stacks"):
        lines.append(f"hang: ranks behind: {', '.join(map(str, stacks.get('behind', [])))}")
        for rank, info in sorted(stacks.get("ranks", {}).items(), key=lambda kv: int(kv[0])):
            state = "stopped" if info.get("stopped") else "silent" if info.get("silent") else "running"
            lines.append(f"  rank {rank} ({state}, step {info.get('step')}): {info.get('top_frame') or 'no stack'}"
                         + (f" [{info['file']}]" if info.get("file") else ""))
    for other in (e for e in events if e["kind"] not in _SHOWN):
        lines.append(f"{other['kind']}: " + ", ".join(f"{k}={v}" for k, v in other.items() if k not in ("t", "kind")))
    return "\n".join(lines)


_SHOWN = ("start", "end", "summary", "failure", "stacks", "ranks_up")
