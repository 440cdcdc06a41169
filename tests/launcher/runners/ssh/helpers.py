"""Helpers for the SSH tests: paths of the test programs and a line collector for dslaunch runs."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
FAKE = str(ROOT / "tests" / "launcher" / "bin" / "fake_worker.py")
ALLREDUCE = str(ROOT / "scripts" / "examples" / "allreduce.py")
# A launch that fails its preflight answers in ~1-3 s on an idle machine: a new dslaunch process,
# 3 SSH connections and each host's probe, every wait bounded by a connect timeout of 2-4 s. At load
# 30 here it took 10-11 s. The bound rules out an unbounded wait (TCP's 2 min, the store's timeout).
PREFLIGHT_S = 20.0


class Lines:
    """Collects a process's stdout and stderr lines with arrival times, in background threads."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.out: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, d), daemon=True)
                         for s, d in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, dest) -> None:
        for line in stream:
            dest.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, count: int, timeout: float) -> float:
        """Block until ``count`` stdout lines match; return the arrival time of the last one."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hits = [t for t, line in self.out if re.search(pattern, line)]
            if len(hits) >= count:
                return hits[count - 1]
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"{count} lines matching {pattern!r} not seen; stdout={self.text('out')} "
                             f"stderr={self.text('err')}")

    def finish(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(5)
        return code

    def text(self, which: str) -> str:
        return "\n".join(line for _, line in getattr(self, which))


def causes(err) -> dict[str, str]:
    """host -> cause of an ``SSHError`` (its ``failures`` without the messages)."""
    return {host: cause for host, (cause, _msg) in err.failures.items()}
