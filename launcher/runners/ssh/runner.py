"""The SSH runner: one node agent per host over paramiko, all hosts driven by the shared gang loop.

Launch pipeline (``_start_nodes``), every step parallel across hosts:

1. resolve each hostfile name through the ssh config (``connect.resolve``) and connect;
2. run ``remote_command`` on each host: the preflight probe, then the agent in the same process;
3. check the probes (``preflight.check_probes``); on any problem close every session (the agents
   see EOF and exit) and raise ``SSHError`` naming each host and cause;
4. send each agent its NodeSpec: the job's env plus the propagated variables
   (``envfile.collect_env``) and ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` = the interface on
   that host that routes to the master address (unless the user set them).

``MASTER_ADDR`` (``choose_master``) defaults to the first host's address as the ssh config resolves
it (HostName), which the probe confirms every host can reach. When that is this machine's loopback
(hostfile ``localhost`` first) and other hosts are remote, it becomes this machine's address toward
them (one address for all, else an error asking for ``--master_addr``). An explicit
``--master_addr`` is kept as given, except that a loopback one with remote hosts is an error: each
remote host would connect to itself and the job would hang at rendezvous. The probes back this up:
a host that resolves the master address to its own loopback fails preflight unless it is the
master host.

Stopping: closing a session's stdin makes its agent stop its workers (SIGTERM, then SIGKILL after
the grace period) and exit; if the controller dies, the kernel closes its sockets, sshd closes the
agent's stdin, same effect. A lost connection (TCP keepalive, ~6 s) is a node failure.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from dslaunch.errors import UsageError
from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.envfile import collect_env
from dslaunch.launcher.monitor.gang import NodeHandle
from dslaunch.launcher.runners.base import Runner, format_node
from dslaunch.launcher.runners.ssh.connect import (
    SSHError,
    SSHOptions,
    SSHTarget,
    connect_all,
    load_config,
    resolve,
    source_address,
)
from dslaunch.launcher.runners.ssh.preflight import check_probes, gather_probes, probe_request, remote_command
from dslaunch.launcher.runners.ssh.session import RemoteSession
from dslaunch.launcher.runners.ssh.sshlib import paramiko
from dslaunch.launcher.spec import JobSpec, NodeResult, NodeSpec

__all__ = ["SSHRunner", "IFNAME_VARS", "Master", "choose_master", "is_loopback"]

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")


def is_loopback(name: str) -> bool:
    """Does ``name`` mean "this machine" on every host? A loopback IP or a localhost name.

    No DNS on purpose: other names are resolved by each host itself, and its probe checks them.
    """
    name = name.strip("[]").lower().rstrip(".")
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        pass
    try:  # the other IPv4 spellings getaddrinfo takes too: 127.1, 0x7f000001, 2130706433
        return ipaddress.IPv4Address(socket.inet_aton(name)).is_loopback
    except OSError:
        return name in _LOOPBACK_NAMES or name.endswith(".localhost")


@dataclass(frozen=True)
class Master:
    """The rendezvous address every host gets as MASTER_ADDR, and which host it is."""

    addr: str
    on_first: bool
    """The first host is the master host (its probe checks that the master port is free there)."""
    note: str | None = None
    """Why ``addr`` is not the name the user gave, for the user."""

    def is_master_host(self, index: int, target: SSHTarget) -> bool:
        """Is host ``index`` the master's machine (so a loopback master is valid there)?"""
        return (index == 0 and self.on_first) or (is_loopback(self.addr) and is_loopback(target.hostname))


def _names(targets: Sequence[SSHTarget], shown: int = 5) -> str:
    names = ", ".join(t.alias for t in targets[:shown])
    return names + (f" and {len(targets) - shown} more" if len(targets) > shown else "")


def choose_master(master_addr: str, targets: Sequence[SSHTarget],
                  source_toward: Callable[[SSHTarget], str] = source_address) -> Master:
    """MASTER_ADDR for an SSH job (see the module docstring).

    Args:
        master_addr: the plan's: the first host's hostfile name unless ``--master_addr`` was given.
        targets: the hosts in node order.
        source_toward: this machine's address toward a host; asked only when the first host is
            this machine's loopback and some host is remote.

    Raises:
        UsageError: a loopback ``--master_addr`` with remote hosts, or this machine reaches the
            remote hosts through different addresses (no single automatic choice).
        SSHError: a remote host that does not resolve or has no route from here.
    """
    first = targets[0]
    remote = [t for t in targets if not is_loopback(t.hostname)]
    # The plan's default is the first host's name; --master_addr set to that same name means the same.
    if master_addr != first.alias:  # --master_addr: the user's choice, unless it cannot work
        if remote and is_loopback(master_addr):
            raise UsageError(f"--master_addr {master_addr} is a loopback address, which on the remote "
                             f"host(s) {_names(remote)} means that host itself, not the master; pass "
                             "--master_addr with an address of the master host that every host can reach")
        return Master(master_addr, on_first=master_addr == first.hostname)
    if not is_loopback(first.hostname):
        return Master(first.hostname, on_first=True)
    if not remote:
        return Master(master_addr, on_first=True)  # every host is this machine
    # The first host is this machine (ssh reaches it through loopback): its routes are ours.
    sources: dict[str, str] = {}
    failures: dict[str, tuple[str, str]] = {}
    for t in remote:
        try:
            sources[t.alias] = source_toward(t)
        except SSHError as err:
            failures.update(err.failures)
    if failures:
        raise SSHError(failures)
    by_addr = {a: [t for t in remote if sources[t.alias] == a] for a in sorted(set(sources.values()))}
    if len(by_addr) > 1:
        ways = "; ".join(f"{a} toward {_names(ts)}" for a, ts in by_addr.items())
        raise UsageError(f"the first host {first.alias} is this machine's loopback, which remote hosts "
                         f"cannot use as the master address, and this machine has no single address "
                         f"toward them ({ways}); pass --master_addr with an address every host can reach")
    addr = next(iter(by_addr))
    return Master(addr, on_first=True,
                  note=f"MASTER_ADDR={addr}: the first host {first.alias} is this machine's loopback; "
                       f"{addr} is this machine's address toward {_names(remote)}")


class _SSHNode(NodeHandle):
    """A remote agent seen through its SSH session."""

    def __init__(self, node: NodeSpec, session: RemoteSession) -> None:
        self.node = node
        self.session = session
        self._killer: threading.Thread | None = None

    def poll(self) -> NodeResult | None:
        s = self.session
        if not s.done.is_set():
            return None
        if s.status is not None:
            return s.status
        if s.lost:
            os.write(2, f"dslaunch: lost the SSH connection to {self.node.host}\n".encode())
            return NodeResult(self.node.node_rank, self.node.host, s.exit_code or 255,
                              stopped_by="lost SSH connection")
        return NodeResult(self.node.node_rank, self.node.host, s.exit_code or 0)

    def failing(self) -> NodeResult | None:
        return self.session.failure

    def stop(self, sig: int) -> None:
        self.session.close_stdin()

    def kill(self) -> None:
        if self._killer is None:
            pid = (self.session.probe or {}).get("pid")
            self._killer = threading.Thread(target=self.session.kill_remote, args=(pid,), daemon=True)
            self._killer.start()


class SSHRunner(Runner):
    """Runs each node's agent over SSH (paramiko). See the module docstring."""

    name = "ssh"

    def __init__(self, out_fd: int = 1, err_fd: int = 2) -> None:
        super().__init__()
        self._out, self._err = Sink(out_fd), Sink(err_fd)
        self.sessions: dict[str, RemoteSession] = {}

    # -- planning (no network) -----------------------------------------------------------------

    def _targets(self, job: JobSpec) -> list[SSHTarget]:
        options = SSHOptions.from_launcher_args(job.launcher_args, port=job.ssh_port,
                                                accept_new_host_keys=job.ssh_accept_new_host_keys)
        config = load_config(options.config_file)  # one parse for all hosts
        return [resolve(n.host, options, config) for n in job.nodes]

    @staticmethod
    def _node_env(node: NodeSpec, master: str, probe: dict | None, exported: dict[str, str]) -> NodeSpec:
        env = dict(exported)
        iface = ((probe or {}).get("route") or {}).get("iface")
        if iface and iface != "lo":
            for var in IFNAME_VARS:
                env.setdefault(var, iface)  # the user's value (env or env file) wins
        env.update(node.env)
        env["MASTER_ADDR"] = master
        return replace(node, env=env)

    @staticmethod
    def _commands(job: JobSpec, master: Master, targets: list[SSHTarget]) -> list[str]:
        python = job.python or sys.executable
        return [remote_command(python, probe_request(n.cwd, master.addr, job.master_port,
                                                     master.is_master_host(i, t), job.user_script))
                for i, (n, t) in enumerate(zip(job.nodes, targets, strict=True))]

    def dry_run(self, job: JobSpec) -> str:
        targets = self._targets(job)
        master = choose_master(job.master_addr, targets)
        exported = collect_env()
        out = [f"# {master.note}"] if master.note else []
        for t, node, cmd in zip(targets, job.nodes, self._commands(job, master, targets), strict=True):
            port = ["-p", str(t.port)] if t.port != 22 else []
            probe = {"route": {"iface": "<interface routing to MASTER_ADDR, found at launch>"}}
            out.append(f"{shlex.join(['ssh', *port, f'{t.user}@{t.hostname}', cmd])}\n"
                       f"  # stdin: the NodeSpec below (env, cwd, workers) as one JSON line")
            out.append(format_node(self._node_env(node, master.addr, probe, exported)))
        return "\n".join(out)

    # -- launching -----------------------------------------------------------------------------

    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        exported = collect_env()  # before connecting: a bad env file fails fast, nothing started
        targets = self._targets(job)
        master = choose_master(job.master_addr, targets)
        if master.note:
            self._err.write(f"dslaunch: {master.note}\n".encode())
        python = job.python or sys.executable
        for t, cmd in zip(targets, self._commands(job, master, targets), strict=True):
            self.sessions[t.alias] = RemoteSession(t.alias, cmd, self._out, self._err, on_change=wake.set)
        # Each host's command starts as soon as that host is connected.
        connect_all(targets, then=lambda t, transport: self.sessions[t.alias].start(transport))
        try:
            probes = gather_probes(self.sessions, python)
            problems = check_probes(probes, job.nodes[0].cwd, master.addr, job.master_port)
            if problems:
                raise SSHError(problems)
        except BaseException:
            self._close_all()
            raise
        handles: list[NodeHandle] = []
        for node in job.nodes:
            session = self.sessions[node.host]
            session.held_stderr(release=True)
            spec = self._node_env(node, master.addr, probes[node.host], exported)
            try:
                session.send_line(spec.to_json())
            except (OSError, EOFError, paramiko.SSHException) as exc:
                # Started agents see EOF and stop their workers; nothing stays behind.
                self._close_all()
                raise SSHError({node.host: ("ssh", f"connection lost while starting the node: {exc}")}) from None
            handles.append(_SSHNode(spec, session))
        return handles

    def _close_all(self) -> None:
        for s in self.sessions.values():
            s.close()

    def wait(self) -> int:
        try:
            return super().wait()
        finally:
            self._close_all()
