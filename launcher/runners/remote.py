"""What every runner of remote node agents shares: open a session per node, preflight, hand over.

A remote runner (``ssh``, ``slurm``) differs from the others only in its transport: how a session
to one node is opened (``_open_sessions``), why a node gave no answer (``_diagnose``), which
``MASTER_ADDR`` it picks (there too), and how it closes a session. The launch itself is one pipeline,
``RemoteRunner._start_nodes``:

1. open every node's session, each running the preflight probe and then the agent
   (``preflight.agent_argv``);
2. gather the probes and check them (``preflight.check_probes``); on any problem close every
   session (the agents see EOF and exit) and raise the transport's ``HostsError`` naming each
   node and cause;
3. send each agent its NodeSpec, with the env files' variables and the interface toward the
   master address that node's probe found (``workerenv.remote_node``), and keep it alive.

Nothing is left running on a failure at any step: every opened session is closed.
"""

from __future__ import annotations

import sys
import threading
from typing import ClassVar

from dslaunch.errors import HostsError
from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.agent.wire import ALIVE_EVERY_S
from dslaunch.launcher.envfile import collect_env
from dslaunch.launcher.monitor.gang import NodeHandle
from dslaunch.launcher.runners.base import Runner
from dslaunch.launcher.runners.preflight import check_probes, gather_probes
from dslaunch.launcher.runners.stream import AgentStream, StreamNode
from dslaunch.launcher.spec import JobSpec, NodeSpec
from dslaunch.launcher.workerenv import remote_node

__all__ = ["RemoteRunner", "probe_iface", "IFACE_AT_LAUNCH"]

# What --dry-run shows for the interface a node's probe would find.
IFACE_AT_LAUNCH = "<interface routing to MASTER_ADDR, found at launch>"


def probe_iface(probe: dict | None) -> str | None:
    """The interface toward the master address that a node's probe found (None: not known)."""
    return ((probe or {}).get("route") or {}).get("iface")


class RemoteRunner(Runner):
    """A runner whose node agents are reached through one session (``AgentStream``) per node.

    Subclasses set the class attributes and implement ``_open_sessions`` and
    ``_diagnose``; they may override ``_exported`` and ``_close_all``.

    Class attributes:
        error: the transport's ``HostsError`` subclass.
        node_type: the ``StreamNode`` subclass that wraps a started session for the gang.
        cause: the failure cause naming the transport (``ssh``, ``srun``).
        lost_on_start: what a failed hand-over means, for the error message.
    """

    error: ClassVar[type[HostsError]] = HostsError
    node_type: ClassVar[type[StreamNode]] = StreamNode
    cause: ClassVar[str] = ""
    lost_on_start: ClassVar[str] = "the connection was lost while starting the node"

    def __init__(self, out_fd: int = 1, err_fd: int = 2) -> None:
        super().__init__()
        self._out, self._err = Sink(out_fd), Sink(err_fd)
        self.sessions: dict[str, AgentStream] = {}

    # -- the transport's part --------------------------------------------------------------------

    def _exported(self) -> dict[str, str]:
        """The variables every worker gets from the env files (read before anything starts)."""
        return collect_env()

    def _open_sessions(self, job: JobSpec, wake: threading.Event) -> str:
        """Fill ``self.sessions`` (node host -> started session; sessions call ``wake.set`` on
        news) and return the ``MASTER_ADDR`` their probes were told.

        Raises the transport's ``HostsError`` when a node cannot be reached.
        """
        raise NotImplementedError

    def _diagnose(self, python: str, exit_code: int | None, stderr: str, lost: bool) -> tuple[str, str]:
        """Why a node answered without a probe line: (cause, message)."""
        raise NotImplementedError

    def _close_all(self) -> None:
        for s in self.sessions.values():
            s.close_stdin()

    # -- the shared pipeline ---------------------------------------------------------------------

    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        exported = self._exported()  # a bad env file fails fast, nothing started
        python = job.python or sys.executable
        try:
            master = self._open_sessions(job, wake)
            probes = gather_probes(self.sessions, python, self._diagnose, self.error)
            problems = check_probes(probes, job.nodes[0].cwd, master, job.master_port)
            if problems:
                raise self.error(problems)
        except BaseException:
            self._close_all()
            raise
        return [self._hand_over(node, master, probes[node.host], exported) for node in job.nodes]

    def _hand_over(self, node: NodeSpec, master: str, probe: dict, exported: dict[str, str]) -> NodeHandle:
        """Send one started agent its NodeSpec; from then on the gang watches it."""
        session = self.sessions[node.host]
        session.held_stderr(release=True)
        spec = remote_node(node, master, exported, probe_iface(probe))
        try:
            session.send_line(spec.to_json())
        except session.transport_errors as exc:
            # Started agents see EOF and stop their workers; nothing stays behind.
            self._close_all()
            raise self.error({node.host: (self.cause, f"{self.lost_on_start}: {exc}")}) from None
        session.keep_alive(ALIVE_EVERY_S)
        return self.node_type(spec, session)
