"""What runs on a Ray node: an actor that owns that node's agent process and relays its stdio.

The actor is the agent's SSH channel: ``start`` runs ``agent.bootstrap`` (probe, then the node
agent) as its child with this node's interpreter; ``read`` returns the next bytes of the agent's
stdout or stderr (b'' at EOF), ``write`` feeds its stdin, ``close_stdin`` is the stop request (the
agent stops its workers and exits, as over SSH). The controller keeps one call per stream in
flight, so a threaded actor (``max_concurrency``) serves both streams and the writes at once.

The actor outlives a run: the job keeps it for the next (``nodes.RayNodes``), and ``start`` runs
a new agent each time. Asked for ``spares`` N, it keeps a standby agent ready for the next run
(``agent.bootstrap --standby N``: N warm spare workers with torch imported, at idle priority), so
that a restart hands the request to an agent that is already up, and its workers to interpreters
that have already imported torch; the first run's agent starts fresh, the standby after it.

When the actor dies (its node lost, ``ray.kill``, the controller gone), the agent's stdin closes
with it: the agent stops its workers as it does when an SSH connection drops (a standby ends its
spares and exits).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

from dslaunch.launcher.agent.bootstrap import STANDBY
from dslaunch.launcher.runners.preflight import agent_argv

__all__ = ["AgentProcess", "STREAMS"]

STREAMS = ("stdout", "stderr")


class AgentProcess:
    """The node agent of one Ray node, started by ``start(request, spares)``
    (``preflight.probe_request``) once per run."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._standby: subprocess.Popen | None = None

    def start(self, request: Mapping, spares: int = 0) -> int:
        """Start this run's agent (the standby, when one is up) with this node's interpreter and,
        with ``spares``, the next run's standby with that many warm spares. Returns the agent's
        pid, which ``write`` and ``close_stdin`` name (a late write of a finished run never
        reaches the next run's agent)."""
        if self._proc is not None and self._proc.poll() is None:  # the last run's, never stopped
            self.kill()
        standby, self._standby = self._standby, None
        if standby is not None and standby.poll() is None:
            self._proc = standby
            self.write(json.dumps(dict(request), separators=(",", ":")).encode() + b"\n", standby.pid)
        else:
            self._proc = _agent(agent_argv(sys.executable, request))
        if spares:
            self._standby = _agent([sys.executable, "-m", "dslaunch.launcher.agent.bootstrap", STANDBY, str(spares)])
        return self._proc.pid

    def read(self, stream: str, size: int) -> bytes:
        """The next bytes of the agent's ``stream`` (one of ``STREAMS``); b'' at its end."""
        return os.read(getattr(self._proc, stream).fileno(), size)

    def write(self, data: bytes, pid: int) -> None:
        if self._proc.pid == pid:
            self._proc.stdin.write(data)
            self._proc.stdin.flush()

    def close_stdin(self, pid: int) -> None:
        if self._proc.pid == pid:
            try:
                self._proc.stdin.close()
            except OSError:
                pass

    def wait(self) -> int:
        """The agent's exit code (128+N for signal N, as a shell says)."""
        code = self._proc.wait()
        return 128 - code if code < 0 else code

    def kill(self) -> None:
        """Last resort: SIGKILL the agent (its workers die with it: PDEATHSIG)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


def _agent(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
