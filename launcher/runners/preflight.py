"""Preflight for any transport that runs ``agent.bootstrap``: is every host ready, before anything
starts anywhere?

Checked on every host from its probe answer, each failure naming the host and its cause:

- the interpreter exists and imports dslaunch (``interpreter``; the transport says why a host
  gave no answer at all);
- the working directory exists there (``cwd``);
- the user script exists there at the same path (``script``);
- the same Python and torch versions as the first host (``version``), torch installed;
- the master address resolves and answers from the host, and is not that host's own loopback
  unless it is the master host (``master``); the master port is free on the master host and
  nothing else answers on it (``port``).

The probe itself runs remotely (``agent.bootstrap``) as the first step of the launch command, so a
passing preflight costs no extra round trip.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Callable, Mapping

from dslaunch.errors import HostsError
from dslaunch.launcher.spec import JobSpec, NodeSpec

__all__ = ["PROBE_TIMEOUT", "probe_request", "node_request", "node_agent_argv", "agent_argv", "remote_command", "stderr_tail",
           "check_probes", "gather_probes"]

# Python start-up plus a login shell's rc files, on a loaded machine.
PROBE_TIMEOUT = 20.0


def probe_request(cwd: str | None, master_addr: str, master_port: int, is_master: bool,
                  script: str | None = None) -> dict:
    return {"cwd": cwd, "master_addr": master_addr, "master_port": master_port, "is_master": is_master,
            "script": script}


def agent_argv(python: str, request: Mapping) -> list[str]:
    """What each host runs: probe, then the node agent (``agent.bootstrap.main``)."""
    return [python, "-m", "dslaunch.launcher.agent.bootstrap", json.dumps(dict(request), separators=(",", ":"))]


def node_request(job: JobSpec, node: NodeSpec) -> dict:
    """``probe_request`` for ``node`` of ``job``: node 0 hosts the rendezvous unless
    ``--master_addr`` named another."""
    return probe_request(node.cwd, job.master_addr, job.master_port, node.node_rank == 0 and not job.master_given,
                         job.user_script)


def node_agent_argv(job: JobSpec, node: NodeSpec) -> list[str]:
    """``agent_argv`` for ``node`` of ``job``, for a transport that runs it as a command line
    (``srun``, ``mpirun``)."""
    return agent_argv(job.python or sys.executable, node_request(job, node))


def remote_command(python: str, request: Mapping, source: str | None = None) -> str:
    """``agent_argv`` as the shell command line an SSH host runs, after sourcing ``source`` if given.

    ``exec`` replaces the login shell, so the python process is sshd's direct child and nothing
    stands between the agent and its SSH channel. Every word is shell-quoted; ``.``, not bash's
    ``source``, so that a host whose login shell is ``sh`` sources it too, and ``&&`` so that a
    script that fails stops there with its own error.
    """
    command = "exec " + shlex.join(agent_argv(python, request))
    return f". {shlex.quote(source)} && {command}" if source else command


def stderr_tail(stderr: str) -> str:
    """The last three lines of a node's stderr as one line (what a "no answer" message quotes)."""
    return " | ".join(stderr.strip().splitlines()[-3:])


def _versions(p: Mapping) -> str:
    return f"Python {p.get('python')} ({p.get('implementation')}), torch {p.get('torch')}"


def _master_problem(p: Mapping, master: str, port: int) -> tuple[str, str] | None:
    status = p.get("master", {})
    where = f"{master}" + (f" ({p['master_ip']})" if p.get("master_ip") not in (None, master) else "")
    if status.get("status") == "unresolvable":
        return "master", (f"cannot resolve the master address {master!r} here ({status.get('detail')}); "
                          "pass --master_addr with an address every host can reach")
    if status.get("status") == "loopback":
        return "master", (f"the master address {where} is this host's own loopback here, not the master "
                          "host; pass --master_addr with an address every host can reach")
    if status.get("status") == "unreachable":
        return "master", (f"cannot reach the master address {where} port {port} from here: "
                          f"{status.get('detail')}; pass --master_addr with an address every host can reach")
    port_state = p.get("port", {})
    if status.get("status") == "busy" or port_state.get("free") is False:
        detail = port_state.get("detail") or (f"master port {port} on {where} already accepts "
                                              "connections; pick a free port with --master_port")
        return "port", detail
    return None


def check_probes(probes: Mapping[str, Mapping], cwd: str | None, master: str, port: int) -> dict[str, tuple[str, str]]:
    """Problems per host (empty when all is well). ``probes`` in node order; the first is the reference."""
    problems: dict[str, tuple[str, str]] = {}
    ref_host, ref = next(iter(probes.items()))
    for host, p in probes.items():
        if p.get("error"):
            problems[host] = ("interpreter", p["error"])
        elif p.get("cwd_error"):
            problems[host] = ("cwd", f"the working directory {cwd} is not usable here ({p['cwd_error']}); "
                                     "run from a directory that exists on every host")
        elif p.get("script_missing"):
            problems[host] = ("script", f"the user script {p['script_missing']} does not exist here (cwd {cwd}); "
                                        "every host needs it at the same path")
        elif p.get("torch") is None:
            problems[host] = ("version", f"torch is not installed for {p.get('executable')}")
        elif _versions(p) != _versions(ref):
            problems[host] = ("version", f"{_versions(p)} here, but {ref_host} has {_versions(ref)}; "
                                         "every host needs the same versions")
        elif (found := _master_problem(p, master, port)) is not None:
            problems[host] = found
    return problems


def gather_probes(sessions: Mapping[str, object], python: str,
                  diagnose: Callable[[str, int | None, str, bool], tuple[str, str]],
                  error: type[HostsError] = HostsError, timeout: float = PROBE_TIMEOUT) -> dict[str, dict]:
    """Wait for every session's probe (``stream.AgentStream``), in parallel.

    Args:
        diagnose: the transport's reason for a host without a probe:
            ``(python, exit code or None, its stderr, connection lost) -> (cause, message)``.
        error: the transport's ``HostsError`` subclass to raise.

    Raises:
        HostsError (``error``): naming each host that did not answer and why.
    """
    deadline = time.monotonic() + timeout
    probes: dict[str, dict] = {}
    failures: dict[str, tuple[str, str]] = {}
    for alias, session in sessions.items():
        probe = session.wait_probe(deadline)
        if probe is not None:
            probes[alias] = probe
            continue
        session.done.wait(0.2 if session.exit_code is None else 0)  # let the exit status arrive
        failures[alias] = diagnose(python, session.exit_code, session.held_stderr(False), session.lost)
    if failures:
        raise error(failures)
    return probes
