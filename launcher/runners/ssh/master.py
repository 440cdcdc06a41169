"""MASTER_ADDR for an SSH job: one rendezvous address every host can reach, and which host it is.

``MASTER_ADDR`` (``choose_master``) defaults to the first host's address as the ssh config resolves
it (HostName), which the probe confirms every host can reach. When that is this machine's loopback
(hostfile ``localhost`` first) and other hosts are remote, it becomes this machine's address toward
them (one address for all, else an error asking for ``--master_addr``). An explicit
``--master_addr`` is kept as given, except that a loopback one with remote hosts is an error: each
remote host would connect to itself and the job would hang at rendezvous. The probes back this up:
a host that resolves the master address to its own loopback fails preflight unless it is the
master host.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dslaunch.errors import UsageError
from dslaunch.launcher.runners.ssh.connect import SSHError, SSHTarget, source_address

__all__ = ["Master", "choose_master", "is_loopback"]

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


def choose_master(requested: str | None, targets: Sequence[SSHTarget],
                  source_toward: Callable[[SSHTarget], str] = source_address) -> Master:
    """MASTER_ADDR for an SSH job (see the module docstring).

    Args:
        requested: ``--master_addr`` as the user gave it; None when left out (``JobSpec.master_given``).
            The first host's own hostfile name means the same as None.
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
    if requested is not None and requested != first.alias:  # the user's choice, unless it cannot work
        if remote and is_loopback(requested):
            raise UsageError(f"--master_addr {requested} is a loopback address, which on the remote "
                             f"host(s) {_names(remote)} means that host itself, not the master; pass "
                             "--master_addr with an address of the master host that every host can reach")
        return Master(requested, on_first=requested == first.hostname)
    if not is_loopback(first.hostname):
        return Master(first.hostname, on_first=True)
    if not remote:
        return Master(first.alias, on_first=True)  # every host is this machine
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
