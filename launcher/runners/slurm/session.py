"""One node agent started through ``srun``: srun's stdio is the agent's channel.

``SrunSession`` runs ``srun --nodes=1 --ntasks=1 --nodelist=<node> ... python -m
dslaunch.launcher.agent.bootstrap '<request>'`` as a child process in a session of its own (a
terminal's Ctrl-C reaches the controller only; srun would otherwise take it as its own "status,
then abort" interrupt) and sorts its output with ``stream.AgentStream``. ``send_line`` writes to
srun's stdin, which srun forwards to the agent; ``close_stdin`` is the stop request (the agent
sees EOF and stops its workers, as over SSH). ``terminate`` is the last resort: SIGTERM to srun,
which has SLURM signal the step's processes, then SIGKILL them after ``KillWait``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable

from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.stream import AgentStream

__all__ = ["SrunSession"]

# srun's own line after the agent's status line said the same (and named the rank).
_SRUN_EXIT_LINE = re.compile(rb"srun: error: \S+: task \d+: Exited with exit code \d+\s*$")


class SrunSession(AgentStream):
    """An ``srun`` child whose stdio is one node agent's. Thread-safe for the methods below."""

    def __init__(self, alias: str, argv: list[str], out: Sink, err: Sink,
                 on_change: Callable[[], None] = lambda: None) -> None:
        super().__init__(alias, out, err, on_change)
        self.argv = argv
        self._proc: subprocess.Popen | None = None
        self._stdin_lock = threading.RLock()  # reentrant: a signal handler may write a request

    def start(self) -> None:
        """Start srun; readers run in threads. Raises OSError when srun cannot be executed."""
        proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, bufsize=0, start_new_session=True)
        self._proc = proc
        readers = [threading.Thread(target=self._read, args=(_reader(proc.stdout), self._stdout_line), daemon=True),
                   threading.Thread(target=self._read, args=(_reader(proc.stderr), self._stderr_line), daemon=True)]
        for t in readers:
            t.start()
        threading.Thread(target=self._finish, args=(proc, readers), daemon=True, name=f"srun-{self.alias}").start()

    def _finish(self, proc: subprocess.Popen, readers: list[threading.Thread]) -> None:
        for t in readers:
            t.join()
        code = proc.wait()
        # srun ends without the agent's status line when the node or the step was lost.
        self._ended(128 - code if code < 0 else code, lost=self.status is None and code != 0)

    def _stderr_line(self, line: bytes) -> None:
        if self.status is not None and _SRUN_EXIT_LINE.match(line):
            return
        super()._stderr_line(line)

    def send_line(self, text: str) -> None:
        assert self._proc is not None and "\n" not in text
        with self._stdin_lock:
            self._proc.stdin.write((text + "\n").encode())
            self._proc.stdin.flush()

    def close_stdin(self) -> None:
        """EOF on the agent's stdin: it stops its workers and exits. Non-blocking, idempotent."""
        if self._proc is not None:
            with self._stdin_lock:
                try:
                    self._proc.stdin.close()
                except OSError:
                    pass

    def terminate(self) -> None:
        """Last resort: SIGTERM to srun (SLURM then signals and kills the step's processes)."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                os.kill(self._proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def _reader(stream) -> Callable[[int], bytes]:
    fd = stream.fileno()
    return lambda n: os.read(fd, n)
