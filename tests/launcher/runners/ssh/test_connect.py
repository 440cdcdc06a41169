"""SSH connections against the real test cluster: config resolution, host keys, auth, errors."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.runners.ssh.connect import SSHError, SSHOptions, connect, connect_all, resolve
from tests.launcher.runners.ssh.helpers import causes

pytestmark = pytest.mark.cluster


def _opts(cluster, **kw) -> SSHOptions:
    return SSHOptions(config_file=cluster.ssh_config, **kw)


def _run(transport, command: str) -> str:
    chan = transport.open_session()
    chan.exec_command(command)
    out = chan.makefile("rb").read().decode()
    assert chan.recv_exit_status() == 0
    return out


@pytest.mark.timeout(30)
def test_each_host_has_its_own_sshd_and_hostname(cluster):
    transports = connect_all([resolve(h, _opts(cluster)) for h in cluster.hosts])
    try:
        for host, addr in zip(cluster.hosts, cluster.addrs, strict=True):
            out = _run(transports[host], "hostname; cat /proc/net/fib_trie | grep -c 10.213.7.; hostname -I")
            name, _count, ips = out.split("\n")[:3]
            assert name == host
            assert ips.split() == [addr]
        # one sshd per namespace, each a different process
        assert len({cluster.sshd_pid(h) for h in cluster.hosts}) == len(cluster.hosts)
    finally:
        for t in transports.values():
            t.close()


def test_config_is_honoured_and_cli_wins(cluster, tmp_path):
    t = resolve(cluster.hosts[1], _opts(cluster))
    assert (t.hostname, t.port, t.user) == (cluster.addrs[1], 22, "root")
    assert t.identity_files == (cluster.identity,)
    assert t.known_hosts_files[0] == cluster.known_hosts
    opts = SSHOptions.from_launcher_args(f"-F {cluster.ssh_config} -p 2222 -l root -o ConnectTimeout=2",
                                         port=None)
    t2 = resolve(cluster.hosts[1], opts)
    assert (t2.port, t2.connect_timeout) == (2222, 2.0)
    over = SSHOptions.from_launcher_args(f"-F {cluster.ssh_config} -p 2222", port=22)  # --ssh_port wins
    assert resolve(cluster.hosts[1], over).port == 22
    with pytest.raises(UsageError, match="-X"):
        SSHOptions.from_launcher_args("-X")
    with pytest.raises(UsageError, match="does not exist"):
        resolve("h", SSHOptions(config_file=str(tmp_path / "missing")))


@pytest.mark.timeout(30)
def test_ssh_port_2222_connects_wrong_port_is_refused(cluster):
    connect(resolve(cluster.hosts[0], _opts(cluster, port=2222))).close()
    start = time.monotonic()
    with pytest.raises(SSHError) as err:
        connect(resolve(cluster.hosts[0], _opts(cluster, port=2223)))
    assert causes(err.value) == {cluster.hosts[0]: "refused"}
    assert "refused" in str(err.value) and "2223" in str(err.value) and cluster.hosts[0] in str(err.value)
    assert time.monotonic() - start < 2


@pytest.mark.timeout(30)
def test_unknown_host_key_rejected_then_accepted_when_asked(cluster, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    host = cluster.hosts[2]
    with pytest.raises(SSHError) as err:
        connect(resolve(host, _opts(cluster, known_hosts_files=(str(known),))))
    assert causes(err.value) == {host: "unknown-host-key"}
    assert "--ssh_accept_new_host_keys" in str(err.value) and "SHA256:" in str(err.value)
    connect(resolve(host, _opts(cluster, known_hosts_files=(str(known),), accept_new_host_keys=True))).close()
    recorded = known.read_text()
    assert recorded.startswith(cluster.addrs[2] + " ssh-ed25519 ")
    connect(resolve(host, _opts(cluster, known_hosts_files=(str(known),)))).close()  # now known


@pytest.mark.timeout(30)
def test_changed_host_key_is_refused_even_with_accept_new(cluster, tmp_path):
    real = dict(line.split(" ", 1) for line in open(cluster.known_hosts).read().splitlines())
    names = list(real)
    known = tmp_path / "known_hosts"
    # node1's names with node2's key: what a man in the middle would look like
    known.write_text(f"{names[0]} {real[names[1]]}\n")
    with pytest.raises(SSHError) as err:
        connect(resolve(cluster.hosts[0], _opts(cluster, known_hosts_files=(str(known),),
                                                 accept_new_host_keys=True)))
    assert causes(err.value) == {cluster.hosts[0]: "changed-host-key"}
    assert "HOST KEY CHANGED" in str(err.value)


@pytest.mark.timeout(30)
def test_bad_key_is_an_auth_error_naming_user_host_and_key(cluster, tmp_path):
    key = tmp_path / "id_other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    config = tmp_path / "ssh_config"
    config.write_text(f"Host {cluster.hosts[0]}\n  HostName {cluster.addrs[0]}\n  User root\n"
                      f"  IdentityFile {key}\n  IdentitiesOnly yes\n  UserKnownHostsFile {cluster.known_hosts}\n")
    with pytest.raises(SSHError) as err:
        connect(resolve(cluster.hosts[0], SSHOptions(config_file=str(config))))
    assert causes(err.value) == {cluster.hosts[0]: "auth"}
    assert f"root@{cluster.addrs[0]}" in str(err.value) and str(key) in str(err.value)


@pytest.mark.timeout(30)
def test_silent_port_times_out_and_all_failures_are_reported_together(cluster):
    # A listener on the bridge address that accepts but never speaks SSH.
    server = socket.socket()
    server.bind(("10.213.7.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    held: list[socket.socket] = []

    def accept_silently() -> None:
        try:
            while True:
                held.append(server.accept()[0])
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=accept_silently, daemon=True).start()
    opts = SSHOptions.from_launcher_args(f"-F {cluster.ssh_config} -o ConnectTimeout=1")
    silent = resolve("10.213.7.1", SSHOptions(port=port, connect_timeout=1.0))
    nobody = resolve("10.213.7.99", opts)  # in the subnet, no such host
    ok = resolve(cluster.hosts[0], opts)
    start = time.monotonic()
    with pytest.raises(SSHError) as err:
        connect_all([ok, silent, nobody])
    elapsed = time.monotonic() - start
    server.close()
    assert causes(err.value) == {"10.213.7.1": "timeout", "10.213.7.99": causes(err.value)["10.213.7.99"]}
    assert causes(err.value)["10.213.7.99"] in ("timeout", "unreachable")
    assert "2 hosts failed" in str(err.value)
    assert elapsed < 4.5  # in parallel, each bounded by its connect timeout (ARP gives up at ~3 s)


def test_launcher_args_ssh_options(tmp_path):
    config = tmp_path / "config"
    config.write_text("Host a\n  HostName 10.0.0.5\n  Port 2200\n  User bob\n  IdentityFile ~/k1\n"
                      "  StrictHostKeyChecking accept-new\n  ConnectTimeout 7\n")
    t = resolve("a", SSHOptions.from_launcher_args(f"-F {config}"))
    assert (t.hostname, t.port, t.user, t.accept_new_host_keys, t.connect_timeout) == ("10.0.0.5", 2200, "bob", True, 7.0)
    assert t.identity_files[0].endswith("/k1") and not t.identity_files[0].startswith("~")
    t = resolve("a", SSHOptions.from_launcher_args(
        f"-F {config} -i /x/id -l carol -o UserKnownHostsFile=/kh -o IdentityFile=/y/id -o Port=2300"))
    assert (t.port, t.user, t.identity_files[:2], t.known_hosts_files[0]) == (2300, "carol", ("/x/id", "/y/id"), "/kh")
    t = resolve("other", SSHOptions.from_launcher_args(f"-F {config} -o StrictHostKeyChecking=no"))
    assert (t.hostname, t.port, t.accept_new_host_keys) == ("other", 22, True)
    for bad, needle in (("-o Compression=yes", "unsupported ssh option"), ("-p 99999", "not a TCP port"),
                        ("-F", "-F FILE")):
        with pytest.raises(UsageError, match=needle):
            SSHOptions.from_launcher_args(bad)


def test_a_jump_host_in_the_ssh_config_is_refused_not_skipped(tmp_path):
    """dslaunch connects straight to each host: a ProxyJump/ProxyCommand it ignored would connect
    elsewhere than ssh(1) does (or time out), so it is one line naming the host and the key."""
    config = tmp_path / "config"
    config.write_text("Host a\n  ProxyJump bastion\nHost b\n  ProxyCommand ssh -W %h:%p gw\n"
                      "Host c\n  ProxyJump none\n")
    for alias, name in (("a", "ProxyJump"), ("b", "ProxyCommand")):
        with pytest.raises(UsageError, match=f"^ssh config {name} for {alias}: .* does not support jump hosts"):
            resolve(alias, SSHOptions(config_file=str(config)))
    assert resolve("c", SSHOptions(config_file=str(config))).hostname == "c"
