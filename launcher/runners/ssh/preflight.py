"""Preflight for SSH launches: the shared checks (``runners.preflight``) plus why a host gave no
answer over SSH (``diagnose_no_probe``).

Reachability and login (refused, timeout, unreachable, auth, unknown or changed host key) are
checked by ``connect`` before the probe runs.
"""

from __future__ import annotations

from collections.abc import Mapping

from dslaunch.launcher.runners.preflight import (
    PROBE_TIMEOUT,
    check_probes,
    probe_request,
    remote_command,
    stderr_tail,
)
from dslaunch.launcher.runners.preflight import gather_probes as _gather_probes
from dslaunch.launcher.runners.ssh.connect import SSHError

__all__ = ["PROBE_TIMEOUT", "probe_request", "remote_command", "diagnose_no_probe", "check_probes",
           "gather_probes"]


def diagnose_no_probe(python: str, exit_code: int | None, stderr: str, lost: bool = False) -> tuple[str, str]:
    """Why a host answered without a probe line: (cause, message)."""
    tail = stderr_tail(stderr)
    if lost:
        return "ssh", "the SSH connection dropped before the host answered"
    if exit_code is None:
        return "timeout", f"{python} did not answer within {PROBE_TIMEOUT:g}s (host overloaded?)"
    if exit_code == 127 or "No such file or directory" in stderr and python in stderr:
        return "interpreter", (f"python interpreter {python} not found on this host (exit {exit_code}); "
                               "the controller's interpreter path must exist on every host")
    if exit_code == 126:
        return "interpreter", f"{python} is not executable on this host: {tail}"
    if "No module named" in stderr:
        return "interpreter", f"{python} cannot import dslaunch on this host: {tail}"
    return "interpreter", f"the remote command exited with code {exit_code}: {tail or 'no output'}"


def gather_probes(sessions: Mapping[str, object], python: str, timeout: float = PROBE_TIMEOUT) -> dict[str, dict]:
    """Wait for every session's probe (``session.RemoteSession``), in parallel.

    Raises:
        SSHError: naming each host that did not answer and why.
    """
    return _gather_probes(sessions, python, diagnose_no_probe, SSHError, timeout)
