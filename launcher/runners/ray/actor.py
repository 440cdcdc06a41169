"""What runs on a Ray node: an actor that owns that node's agent process and relays its stdio.

The actor is the agent's SSH channel: ``start`` runs ``agent.bootstrap`` (probe, then the node
agent) as its child with this node's interpreter; ``read`` returns the next bytes of the agent's
stdout or stderr (b'' at EOF), ``write`` feeds its stdin, ``close_stdin`` is the stop request (the
agent stops its workers and exits, as over SSH). The controller keeps one call per stream in
flight, so a threaded actor (``max_concurrency``) serves both streams and the writes at once.

When the actor dies (its node lost, ``ray.kill``, the controller gone), the agent's stdin closes
with it: the agent stops its workers as it does when an SSH connection drops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping

from dslaunch.launcher.runners.preflight import agent_argv

__all__ = ["AgentProcess", "STREAMS"]

STREAMS = ("stdout", "stderr")


class AgentProcess:
    """The node agent of one Ray node, started by ``start(request)`` (``preflight.probe_request``)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def start(self, request: Mapping) -> str:
        """Start the agent with this node's interpreter; return the Ray node id it runs on."""
        import ray

        self._proc = subprocess.Popen(agent_argv(sys.executable, request), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0)
        return ray.get_runtime_context().get_node_id()

    def read(self, stream: str, size: int) -> bytes:
        """The next bytes of the agent's ``stream`` (one of ``STREAMS``); b'' at its end."""
        return os.read(getattr(self._proc, stream).fileno(), size)

    def write(self, data: bytes) -> None:
        self._proc.stdin.write(data)
        self._proc.stdin.flush()

    def close_stdin(self) -> None:
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
