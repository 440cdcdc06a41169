"""MASTER_ADDR for SSH jobs: never a loopback address that remote hosts would take for themselves.

Unit tests of ``choose_master`` and the probe's loopback rule, then the real thing on the test
cluster: ``localhost`` (this machine's root namespace, reached through an sshd on 127.0.0.1 that
the test starts) plus a namespace host, which must meet at this machine's bridge address.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.agent.bootstrap import probe
from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.ssh.connect import (
    SSHError,
    SSHOptions,
    SSHTarget,
    connect,
    resolve,
    source_address,
)
from dslaunch.launcher.runners.ssh.master import Master, choose_master, is_loopback
from dslaunch.launcher.runners.ssh.preflight import check_probes, probe_request, remote_command
from dslaunch.launcher.runners.ssh.session import RemoteSession
from dslaunch.utils.ports import free_port as another_free_port
from tests.launcher.runners.ssh.helpers import ALLREDUCE, FAKE, ROOT, Lines, causes

BRIDGE_ADDR = "10.213.7.1"  # the root namespace's address on the cluster bridge (scripts/cluster)


def _t(alias: str, hostname: str | None = None) -> SSHTarget:
    return SSHTarget(alias=alias, hostname=hostname or alias)


class _Routes:
    """A fake ``source_toward``: this machine's address toward each host, recording who was asked."""

    def __init__(self, **by_host: str) -> None:
        self.by_host, self.asked = by_host, []

    def __call__(self, t: SSHTarget) -> str:
        self.asked.append(t.alias)
        if self.by_host[t.alias] == "unresolvable":
            raise SSHError({t.alias: ("unknown-host", f"cannot resolve host name {t.hostname!r}")})
        return self.by_host[t.alias]


@pytest.mark.parametrize("name, loopback", [
    ("localhost", True), ("LOCALHOST.", True), ("a.localhost", True), ("ip6-localhost", True),
    ("127.0.0.1", True), ("127.0.1.1", True), ("127.1", True), ("2130706433", True), ("::1", True),
    ("[::1]", True), ("10.213.7.1", False), ("node1", False), ("localhost-2", False), ("1234", False),
])
def test_is_loopback_without_dns(name, loopback):
    assert is_loopback(name) is loopback


def test_default_master_is_the_first_hosts_ssh_address():
    routes = _Routes()
    m = choose_master("n1", [_t("n1", "10.0.0.1"), _t("n2", "10.0.0.2")], routes)
    assert m == Master("10.0.0.1", on_first=True) and routes.asked == []
    assert choose_master(None, [_t("n1", "10.0.0.1"), _t("n2", "10.0.0.2")], routes) == m  # not given


def test_localhost_first_becomes_this_machines_address_toward_the_remote_hosts():
    routes = _Routes(n2="10.0.0.9", n3="10.0.0.9")
    targets = [_t("localhost"), _t("n2", "10.0.0.2"), _t("n3", "10.0.0.3")]
    m = choose_master("localhost", targets, routes)
    assert (m.addr, m.on_first) == ("10.0.0.9", True)
    assert m.note == ("MASTER_ADDR=10.0.0.9: the first host localhost is this machine's loopback; "
                      "10.0.0.9 is this machine's address toward n2, n3")
    assert routes.asked == ["n2", "n3"]
    assert [m.is_master_host(i, t) for i, t in enumerate(targets)] == [True, False, False]
    # an ssh config can make any name the loopback: HostName is what counts
    m = choose_master("box", [_t("box", "127.0.0.1"), _t("n2", "10.0.0.2")], _Routes(n2="10.0.0.9"))
    assert m.addr == "10.0.0.9"


def test_localhost_first_with_several_ways_out_asks_for_master_addr():
    routes = _Routes(n2="10.0.0.9", n3="192.168.5.1", n4="10.0.0.9")
    with pytest.raises(UsageError) as err:
        choose_master("localhost", [_t("localhost"), _t("n2", "10.0.0.2"), _t("n3", "192.168.5.3"),
                                    _t("n4", "10.0.0.4")], routes)
    assert str(err.value) == (
        "the first host localhost is this machine's loopback, which remote hosts cannot use as the master "
        "address, and this machine has no single address toward them (10.0.0.9 toward n2, n4; 192.168.5.1 "
        "toward n3); pass --master_addr with an address every host can reach")


def test_localhost_first_and_an_unresolvable_host_names_that_host():
    with pytest.raises(SSHError) as err:
        choose_master("localhost", [_t("localhost"), _t("n2"), _t("n3")], _Routes(n2="10.0.0.9", n3="unresolvable"))
    assert causes(err.value) == {"n3": "unknown-host"}


@pytest.mark.parametrize("given", ["127.0.0.1", "localhost", "::1", "127.0.1.1"])
def test_a_given_loopback_master_addr_with_remote_hosts_is_an_error(given):
    routes = _Routes()
    with pytest.raises(UsageError) as err:
        choose_master(given, [_t("n1", "10.0.0.1"), _t("n2", "10.0.0.2")], routes)
    assert str(err.value) == (f"--master_addr {given} is a loopback address, which on the remote host(s) "
                              "n1, n2 means that host itself, not the master; pass --master_addr with an "
                              "address of the master host that every host can reach")
    assert routes.asked == []
    many = [_t(f"n{k}", f"10.0.0.{k}") for k in range(1, 9)]
    with pytest.raises(UsageError, match=r"remote host\(s\) n1, n2, n3, n4, n5 and 3 more means"):
        choose_master(given, many, routes)


def test_a_given_master_addr_is_kept_and_loopback_is_fine_when_every_host_is_this_machine():
    assert choose_master("10.0.0.7", [_t("n1", "10.0.0.1"), _t("n2")], _Routes()) == Master("10.0.0.7", False)
    assert choose_master("10.0.0.1", [_t("n1", "10.0.0.1"), _t("n2")], _Routes()) == Master("10.0.0.1", True)
    local = [_t("localhost"), _t("127.0.0.1")]
    m = choose_master("127.0.0.1", local, _Routes())
    assert m == Master("127.0.0.1", False) and all(m.is_master_host(i, t) for i, t in enumerate(local))
    assert choose_master("localhost", local, _Routes()) == Master("localhost", True)


def test_source_address_of_this_machine():
    assert source_address(_t("me", "127.0.0.1")) == "127.0.0.1"


def test_probe_never_calls_its_own_loopback_the_master_unless_it_is_the_master_host(free_port):
    for master in ("127.0.0.1", "localhost"):
        found = probe({"master_addr": master, "master_port": free_port, "is_master": False})
        assert found["master"] == {"status": "loopback"} and found["master_ip"] == "127.0.0.1"
        assert "route" not in found
        problems = check_probes({"h": {**found, "python": "3", "torch": "2"}}, "/w", master, free_port)
        assert problems == {"h": ("master", f"the master address {master}"
                                            f"{'' if master == '127.0.0.1' else ' (127.0.0.1)'} is this host's "
                                            "own loopback here, not the master host; pass --master_addr with "
                                            "an address every host can reach")}
    found = probe({"master_addr": "127.0.0.1", "master_port": free_port, "is_master": True})
    assert found["master"] == {"status": "ok"} and found["port"] == {"free": True}


# -- on the test cluster ------------------------------------------------------------------------------


@pytest.fixture
def loopback_sshd(cluster, tmp_path) -> str:
    """An sshd on 127.0.0.1 of this machine (the root namespace): the hostfile's ``localhost``.

    Returns an ssh config with a ``localhost`` block for it plus the cluster's hosts.
    """
    key = tmp_path / "host_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    port = another_free_port()
    config = tmp_path / "sshd_config"
    config.write_text(f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {key}\nPidFile {tmp_path / 'sshd.pid'}\n"
                      f"AuthorizedKeysFile {cluster.state_dir / 'authorized_keys'}\nUsePAM no\nStrictModes no\n"
                      "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                      "PermitRootLogin prohibit-password\nUseDNS no\nLogLevel ERROR\n")
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    try:
        _wait_ssh_banner("127.0.0.1", port, sshd, timeout=10)
        known = tmp_path / "known_hosts"
        host_key = " ".join(Path(f"{key}.pub").read_text().split()[:2])
        known.write_text(Path(cluster.known_hosts).read_text() + f"[127.0.0.1]:{port} {host_key}\n")
        ssh_config = tmp_path / "ssh_config"
        ssh_config.write_text(f"Host localhost\n  HostName 127.0.0.1\n  Port {port}\n  User root\n"
                              f"  IdentityFile {cluster.identity}\n  IdentitiesOnly yes\n"
                              f"  UserKnownHostsFile {known}\n\n" + Path(cluster.ssh_config).read_text())
        yield str(ssh_config)
    finally:
        sshd.terminate()
        sshd.wait(5)


def _wait_ssh_banner(addr: str, port: int, sshd: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sshd.poll() is not None:
            raise AssertionError(f"sshd exited: {sshd.stderr.read().decode()}")
        try:
            with socket.create_connection((addr, port), timeout=0.5) as s:
                if s.recv(4) == b"SSH-":
                    return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"sshd on {addr}:{port} did not answer within {timeout}s")


def _localhost_and_node2(tmp_path, cluster) -> str:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"localhost slots=1\n{cluster.hosts[1]} slots=1\n")
    return str(hostfile)


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_dry_run_localhost_first_shows_the_bridge_address(cluster, tmp_path, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--dry-run", FAKE,
                                 hostfile=_localhost_and_node2(tmp_path, cluster)))
    assert run.finish(20) == 0, run.text("err")
    out = run.text("out")
    assert out.splitlines()[0] == (f"# MASTER_ADDR={BRIDGE_ADDR}: the first host localhost is this machine's "
                                   f"loopback; {BRIDGE_ADDR} is this machine's address toward {cluster.hosts[1]}")
    requests = [json.loads(shlex.split(shlex.split(line)[2])[-1]) for line in out.splitlines()
                if line.startswith("ssh ")]
    assert [(r["master_addr"], r["is_master"]) for r in requests] == [(BRIDGE_ADDR, True), (BRIDGE_ADDR, False)]
    assert len(re.findall(rf"(?m)^.* MASTER_ADDR={BRIDGE_ADDR} .*{FAKE}", out)) == 2
    assert "MASTER_ADDR=localhost" not in out


@pytest.mark.cluster
@pytest.mark.timeout(90)
def test_localhost_and_a_remote_host_meet_at_this_machines_bridge_address(cluster, loopback_sshd, tmp_path,
                                                                           free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), ALLREDUCE, "--timeout", "30",
                                 hostfile=_localhost_and_node2(tmp_path, cluster),
                                 launcher_args=f"-F {loopback_sshd}"))
    assert run.finish(80) == 0, run.text("err")
    assert f"dslaunch: MASTER_ADDR={BRIDGE_ADDR}: the first host localhost" in run.text("err")
    sums = re.findall(r"^(\S+): \[rank(\d)\] rank \d/2 .*: all_reduce sum 3 \(expected 3\)$", run.text("out"), re.M)
    assert sorted(sums) == [(cluster.hosts[1], "1"), ("localhost", "0")], run.text("out")
    assert cluster.wait_no_job_processes(3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_loopback_master_addr_with_remote_hosts_fails_before_connecting(cluster, free_port):
    start = time.monotonic()
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--master_addr", "127.0.0.1", FAKE, "print=ran"))
    assert run.finish(20) == 2
    assert time.monotonic() - start < 10  # no connect, no probe: a plain interpreter start
    assert run.text("err") == ("dslaunch: error: --master_addr 127.0.0.1 is a loopback address, which on the "
                               f"remote host(s) {', '.join(cluster.hosts)} means that host itself, not the "
                               "master; pass --master_addr with an address of the master host that every "
                               "host can reach")
    assert "ran" not in run.text("out") and cluster.wait_no_job_processes(3) == {}


@pytest.mark.cluster
@pytest.mark.timeout(60)
def test_the_probe_on_a_remote_host_rejects_its_own_loopback(cluster, free_port):
    """The probe's own rule, on a real host: whatever the controller thought, "localhost" there is
    that host, so it must not be reported as a reachable master."""
    host = cluster.hosts[1]
    target = resolve(host, SSHOptions(config_file=cluster.ssh_config))
    null = os.open(os.devnull, os.O_WRONLY)
    found = {}
    try:
        for is_master in (False, True):
            cmd = remote_command(sys.executable, probe_request(str(ROOT), "localhost", free_port, is_master))
            session = RemoteSession(host, cmd, Sink(null), Sink(null))
            session.start(connect(target))
            try:
                found[is_master] = session.wait_probe(time.monotonic() + 20)
            finally:
                session.close_stdin()  # the agent sees EOF and exits
                session.done.wait(5)
                session.close()
    finally:
        os.close(null)
    assert found[False]["hostname"] == host and found[False]["master"] == {"status": "loopback"}
    problems = check_probes({host: found[False]}, str(ROOT), "localhost", free_port)
    assert problems[host][0] == "master" and "is this host's own loopback here" in problems[host][1]
    assert found[True]["master"] == {"status": "ok"}  # the master host itself: loopback is fine
    assert cluster.wait_no_job_processes(3) == {}
