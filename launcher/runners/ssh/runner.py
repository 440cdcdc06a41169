"""The SSH runner: one node agent per host over paramiko, all hosts driven by the shared gang loop.

Launch pipeline (``remote.RemoteRunner``: open, preflight, hand over), every step parallel across
hosts; the SSH part is opening:

1. resolve each hostfile name through the ssh config (``connect.resolve``) and connect;
2. run ``remote_command`` on each host: the preflight probe, then the agent in the same process.

On any problem every session is closed (the agents see EOF and exit) and ``SSHError`` names each
host and cause.

``MASTER_ADDR`` is chosen by ``master.choose_master`` (see there).

Stopping: closing a session's stdin makes its agent stop its workers (SIGTERM, then SIGKILL after
the grace period) and exit; if the controller dies, the kernel closes its sockets, sshd closes the
agent's stdin, same effect. A lost connection (TCP keepalive, ~6 s) is a node failure.
"""

from __future__ import annotations

import shlex
import sys
import threading

from dslaunch.errors import shorten
from dslaunch.launcher.log_level import shown
from dslaunch.launcher.runners.base import format_node
from dslaunch.launcher.runners.preflight import stderr_tail
from dslaunch.launcher.runners.remote import IFACE_AT_LAUNCH, RemoteRunner
from dslaunch.launcher.runners.ssh.connect import (
    SSHError,
    SSHOptions,
    SSHTarget,
    connect_all,
    load_config,
    resolve,
)
from dslaunch.launcher.runners.ssh.master import Master, choose_master
from dslaunch.launcher.runners.ssh.preflight import diagnose_no_probe, probe_request, remote_command
from dslaunch.launcher.runners.ssh.session import RemoteSession
from dslaunch.launcher.runners.stream import StreamNode
from dslaunch.launcher.spec import JobSpec, NodeSpec
from dslaunch.launcher.workerenv import remote_node

__all__ = ["SSHRunner"]


class _SSHNode(StreamNode):
    """A remote agent seen through its SSH session."""

    session: RemoteSession

    def __init__(self, node: NodeSpec, session: RemoteSession) -> None:
        super().__init__(node, session)
        self._killer: threading.Thread | None = None

    def lost(self) -> tuple[str, str]:
        return f"lost the SSH connection to {self.node.host}", "lost SSH connection"

    def kill(self) -> None:
        if self._killer is None:
            pid = (self.session.probe or {}).get("pid")
            self._killer = threading.Thread(target=self.session.kill_remote, args=(pid,), daemon=True)
            self._killer.start()


class SSHRunner(RemoteRunner):
    """Runs each node's agent over SSH (paramiko). See the module docstring."""

    name = "ssh"
    error = SSHError
    node_type = _SSHNode
    cause = "ssh"
    lost_on_start = "connection lost while starting the node"

    # -- planning (no network) -----------------------------------------------------------------

    def _targets(self, job: JobSpec) -> list[SSHTarget]:
        options = SSHOptions.from_launcher_args(job.launcher_args, port=job.ssh_port,
                                                accept_new_host_keys=job.ssh_accept_new_host_keys)
        config = load_config(options.config_file)  # one parse for all hosts
        return [resolve(n.host, options, config) for n in job.nodes]

    @staticmethod
    def _commands(job: JobSpec, master: Master, targets: list[SSHTarget]) -> list[str]:
        python = job.python or sys.executable
        return [remote_command(python, probe_request(n.cwd, master.addr, job.master_port,
                                                     master.is_master_host(i, t), job.user_script), job.venv_script)
                for i, (n, t) in enumerate(zip(job.nodes, targets, strict=True))]

    def dry_run(self, job: JobSpec) -> str:
        targets = self._targets(job)
        master = choose_master(job.master_addr if job.master_given else None, targets)
        exported = self._exported()
        out = [f"# {master.note}"] if master.note else []
        for t, node, cmd in zip(targets, job.nodes, self._commands(job, master, targets), strict=True):
            port = ["-p", str(t.port)] if t.port != 22 else []
            out.append(f"{shlex.join(['ssh', *port, f'{t.user}@{t.hostname}', cmd])}\n"
                       f"  # stdin: the NodeSpec below (env, cwd, workers) as one JSON line")
            out.append(format_node(remote_node(node, master.addr, exported, IFACE_AT_LAUNCH)))
        return "\n".join(out)

    # -- launching (the pipeline is RemoteRunner's) --------------------------------------------

    def _open_sessions(self, job: JobSpec, wake: threading.Event) -> str:
        self._venv_script = job.venv_script
        targets = self._targets(job)
        master = choose_master(job.master_addr if job.master_given else None, targets)
        if master.note and shown(job.log_level, "info"):
            self._err.write(f"dslaunch: {master.note}\n".encode())
        for t, cmd in zip(targets, self._commands(job, master, targets), strict=True):
            self.sessions[t.alias] = RemoteSession(t.alias, cmd, self._out, self._err, on_change=wake.set)
        # Each host's command starts as soon as that host is connected.
        connect_all(targets, then=lambda t, transport: self.sessions[t.alias].start(transport))
        return master.addr

    _venv_script: str | None = None  # the launch's --venv_script, for _diagnose

    def _diagnose(self, python: str, exit_code: int | None, stderr: str, lost: bool) -> tuple[str, str]:
        cause, message = diagnose_no_probe(python, exit_code, stderr, lost)
        if self._venv_script and exit_code and not lost and python not in stderr:
            # The shell stopped before exec: the script could not be sourced or failed in it.
            return "venv_script", (f"sourcing --venv_script {shorten(self._venv_script, 300)} failed here "
                                   f"(exit {exit_code}): {stderr_tail(stderr) or 'no output'}")
        return cause, message

    def _close_all(self) -> None:
        for s in self.sessions.values():
            s.close()

    def wait(self) -> int:
        try:
            return super().wait()
        finally:
            self._close_all()
