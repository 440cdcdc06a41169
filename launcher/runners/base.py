"""The runner interface: start a job's node agents through one transport, then run the gang loop.

A runner (local, ssh, ...) only knows how to start a node agent on a host and talk to it; it
returns one ``NodeHandle`` per node, and ``monitor.Gang`` decides what the nodes' news mean for
the job.

Implementing a runner::

    class MyRunner(Runner):
        name = "my"
        def _start_nodes(self, job, wake): ...   # -> list[NodeHandle]; call wake.set() on news
        def dry_run(self, job): ...               # -> text: what would run where
"""

from __future__ import annotations

import re
import shlex
import signal
import threading
from abc import ABC, abstractmethod

from dslaunch.errors import DslaunchError
from dslaunch.launcher.monitor.events import EventLog
from dslaunch.launcher.monitor.gang import Gang, GangResult, NodeHandle
from dslaunch.launcher.monitor.job import JobMonitor
from dslaunch.launcher.spec import JobSpec, NodeSpec

__all__ = ["Runner", "format_node"]


class Runner(ABC):
    """Starts a job's node agents through one transport and runs the shared gang loop.

    Usage: ``runner.start(job); code = runner.wait()``; ``runner.stop()`` from a signal handler.
    """

    name: str = ""

    def __init__(self) -> None:
        self._gang: Gang | None = None
        self.result: GangResult | None = None

    def start(self, job: JobSpec, events: EventLog | None = None) -> None:
        """Start every node. Raises LaunchError when a node cannot be started (others stopped).

        ``events``: the job's event log (a restart loop passes the same one to every attempt);
        default: a new one in ``job.monitor.log_dir``.
        """
        owned = events is None
        events = EventLog(job.monitor.log_dir) if events is None else events
        monitor = JobMonitor(job, events, owns_log=owned)
        monitor.start()
        wake = threading.Event()
        try:
            handles = self._start_nodes(job, wake)
        except DslaunchError as err:
            monitor.end(err.exit_code, error=str(err))
            raise
        grace = max((n.grace for n in job.nodes), default=0.0)
        self._gang = Gang(handles, wake, grace, monitor)

    def wait(self) -> int:
        """Block until the job ends; return its exit code (the failed rank's, or 0)."""
        assert self._gang is not None, "start() first"
        self.result = self._gang.run()
        return self.result.exit_code

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the whole job (signal-handler safe)."""
        if self._gang is not None:
            self._gang.stop(sig)

    @abstractmethod
    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        """Start one agent per node; handles must ``wake.set()`` whenever they may have news."""

    @abstractmethod
    def dry_run(self, job: JobSpec) -> str:
        """What would be started on each host (commands and environment), as text."""


def format_node(node: NodeSpec) -> str:
    """Human-readable description of one node's workers, for ``--dry-run``."""
    pin = ", each pinned to an equal share of the cores" if node.bind_cores else ""
    lines = [f"# node {node.node_rank}: {node.host} ({len(node.workers)} workers{pin})"]
    if node.cwd:
        lines.append(f"cd {shlex.quote(node.cwd)}")
    for w in node.workers:
        lines.append(_shell_command([*sorted(node.env.items()), *sorted(w.env.items())], w.argv))
    return "\n".join(lines)


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _shell_command(env: list[tuple[str, str]], argv: tuple[str, ...]) -> str:
    """``K=V ... argv``, quoted so that a shell runs exactly that; a name a shell cannot assign
    (``NCCL;id``, from the environment) goes through ``env 'NAME=V'`` instead of running code."""
    plain = [f"{k}={shlex.quote(v)}" for k, v in env if _SHELL_NAME.fullmatch(k)]
    odd = [shlex.quote(f"{k}={v}") for k, v in env if not _SHELL_NAME.fullmatch(k)]
    return " ".join([*plain, *(["env", *odd] if odd else []), shlex.join(argv)])
