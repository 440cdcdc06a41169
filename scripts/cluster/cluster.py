#!/usr/bin/env python3
"""A test cluster of SSH hosts on one Linux machine: ``cluster.py up|down|status|shape [--hosts K]``.

Each host is a network namespace ``dsl-nodeK`` with a veth pair to the bridge ``dsl-br`` in the
root namespace and the address ``10.213.7.(10+K)/24`` (bridge: ``10.213.7.1``). The range is used
only there: the hosts have no default route and forwarding is left alone, so traffic cannot leave.
Every host runs its own Debian ``openssh-server`` sshd (own config, host key and PID file; key-only
root login with a generated key; ports 22 and 2222), started in daemon mode inside its namespace
under ``unshare --uts`` so that ``hostname`` there says ``dsl-nodeK``. ``/etc/netns/<ns>/hosts``
makes the names resolve inside the hosts. All hosts share the machine's file system, PIDs and users.

The state directory (default ``/tmp/dslaunch-cluster``, or ``$DSLAUNCH_CLUSTER_DIR``) receives the
client key ``id_ed25519``, ``known_hosts`` (each host key under its name and address),
``ssh_config`` (one ``Host`` block per host), ``hostfile`` (``dsl-nodeK slots=2``) and
``state.json`` (what ``up`` built; read by the pytest fixture and the benchmark).

Link shaping (``up --link-rate 1gbit [--link-delay 1ms]``, or ``shape`` on a running cluster; ``shape``
without limits removes them): a ``tc`` qdisc on both ends of each host's veth pair limits the
host's traffic to the bridge to that rate (token bucket) and adds that delay in each direction (netem,
where the kernel has it), so traffic between
hosts is slower than within one (as between the nodes of a real cluster), while ranks on the same
host still talk over loopback. ``state.json`` records the settings (``link``).

``up`` and ``down`` are idempotent and take well under a second per host. Needs root, iproute2,
util-linux ``unshare`` and openssh-server (``scripts/system_deps.sh`` installs them).
Standard library only, so any python3 runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PREFIX = "dsl-"
SUBNET = "10.213.7"
BRIDGE = f"{PREFIX}br"
SSH_PORTS = (22, 2222)
SSHD = "/usr/sbin/sshd"
DEFAULT_STATE_DIR = "/tmp/dslaunch-cluster"
# A shaped link's token bucket: what it may send at once (>= one 64 KiB gloo/TCP segment)
BURST_BYTES = 256 * 1024


@dataclass(frozen=True)
class Host:
    """One host of the cluster: its name (= namespace = hostname) and address."""

    name: str
    addr: str
    iface: str = "eth0"

    @classmethod
    def numbered(cls, k: int) -> Host:
        return cls(name=f"{PREFIX}node{k}", addr=f"{SUBNET}.{10 + k}")


def state_dir_default() -> Path:
    return Path(os.environ.get("DSLAUNCH_CLUSTER_DIR", DEFAULT_STATE_DIR))


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _exists_link(name: str, netns: str | None = None) -> bool:
    prefix = ("ip", "-n", netns) if netns else ("ip",)
    return _run(*prefix, "link", "show", name, check=False).returncode == 0


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def missing_facilities() -> str | None:
    """Why a cluster cannot be built here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth and a bridge)"
    for tool in ("ip", "unshare", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"'{tool}' is not installed (run scripts/system_deps.sh)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (openssh-server; run scripts/system_deps.sh)"
    probe = f"{PREFIX}probe{os.getpid() % 10000}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


# --- network -----------------------------------------------------------------------------------

def _bridge_up() -> None:
    if not _exists_link(BRIDGE):
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "addr", "replace", f"{SUBNET}.1/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")


def _host_net_up(host: Host) -> None:
    if host.name not in _namespaces():
        _run("ip", "netns", "add", host.name)
    outer = f"{host.name}v"  # root-namespace end of the veth pair
    if not _exists_link(host.iface, host.name):
        if _exists_link(outer):
            _run("ip", "link", "del", outer)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", f"{host.name}p")
        _run("ip", "link", "set", f"{host.name}p", "netns", host.name)
        _run("ip", "-n", host.name, "link", "set", f"{host.name}p", "name", host.iface)
    _run("ip", "link", "set", outer, "master", BRIDGE, "up")
    _run("ip", "-n", host.name, "addr", "replace", f"{host.addr}/24", "dev", host.iface)
    _run("ip", "-n", host.name, "link", "set", host.iface, "up")
    _run("ip", "-n", host.name, "link", "set", "lo", "up")


@dataclass(frozen=True)
class LinkShape:
    """Per-host link limits: ``rate`` and ``delay`` in tc's units ("1gbit", "1ms"); None: unlimited."""

    rate: str | None = None
    delay: str | None = None

    @property
    def qdisc(self) -> list[str]:
        """The tc qdisc: a token bucket for a rate alone (always built in); netem for a delay (a
        kernel module some kernels lack, this machine's among them)."""
        if self.delay:
            return ["netem", "delay", self.delay, *(["rate", self.rate] if self.rate else [])]
        # latency: the queue's bound
        return ["tbf", "rate", self.rate, "burst", str(BURST_BYTES), "latency", "50ms"] if self.rate else []


def _shape_link(host: Host, shape: LinkShape) -> None:
    """Apply ``shape`` to both directions of ``host``'s link (or remove any shaping)."""
    for ns, dev in ((host.name, host.iface), (None, f"{host.name}v")):
        prefix = ["ip", "netns", "exec", ns] if ns else []
        if not shape.qdisc:
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)  # none there: fine
            continue
        done = _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", *shape.qdisc, check=False)
        if done.returncode != 0:
            raise SystemExit(f"cluster: tc cannot shape {dev} with {' '.join(shape.qdisc)}: "
                             f"{done.stderr.strip()} (a delay needs the kernel's netem module)")


def _write_etc_netns(hosts: list[Host]) -> None:
    # The ::ffff: forms: torch's dual-stack TCPStore sees peers as IPv4-mapped IPv6 addresses and
    # warns when it cannot name them.
    peers = [(f"{SUBNET}.1", f"{PREFIX}gw"), *((h.addr, h.name) for h in hosts)]
    lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{a} {n}" for a, n in peers),
             *(f"::ffff:{a} {n}" for a, n in peers)]
    for host in hosts:
        etc = Path("/etc/netns") / host.name
        etc.mkdir(parents=True, exist_ok=True)
        # ip netns exec bind-mounts these over /etc/{hosts,hostname} inside the namespace.
        (etc / "hosts").write_text("\n".join(lines) + "\n")
        (etc / "hostname").write_text(host.name + "\n")


# --- sshd --------------------------------------------------------------------------------------

def _keygen(path: Path, comment: str) -> None:
    if not path.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path))


def _sshd_config(host: Host, hdir: Path, state: Path) -> str:
    return "\n".join([
        f"ListenAddress {host.addr}",
        *(f"Port {p}" for p in SSH_PORTS),
        f"HostKey {hdir / 'ssh_host_ed25519_key'}",
        f"PidFile {hdir / 'sshd.pid'}",
        f"AuthorizedKeysFile {state / 'authorized_keys'}",
        "UsePAM no",
        "StrictModes no",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitRootLogin prohibit-password",
        "MaxStartups 200:30:400",
        "MaxSessions 200",
        # A controller whose link dies is noticed in ~6 s: sshd then closes the session, and the
        # agent on this host sees EOF and stops its workers.
        "ClientAliveInterval 2",
        "ClientAliveCountMax 3",
        "UseDNS no",
        "PrintMotd no",
        "PrintLastLog no",
        "LogLevel ERROR",
        "",
    ])


def _pid_alive(pidfile: Path) -> int | None:
    try:
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    return pid if str(pidfile.parent).encode() in cmdline else None


def _port_answers(addr: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout) as s:
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def _sshd_up(host: Host, state: Path) -> None:
    hdir = state / host.name
    hdir.mkdir(parents=True, exist_ok=True)
    _keygen(hdir / "ssh_host_ed25519_key", f"host {host.name}")
    config = hdir / "sshd_config"
    text = _sshd_config(host, hdir, state)
    changed = not config.exists() or config.read_text() != text
    config.write_text(text)
    pid = _pid_alive(hdir / "sshd.pid")
    if pid:
        if changed:
            os.kill(pid, signal.SIGHUP)  # sshd re-executes itself with the new config
        return
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    _run("ip", "netns", "exec", host.name, "unshare", "--uts", "sh", "-c",
         f"hostname {host.name} && exec {SSHD} -f {config}")


def _wait_ssh(hosts: list[Host], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    pending = [(h.addr, p) for h in hosts for p in SSH_PORTS]
    while pending and time.monotonic() < deadline:
        pending = [ap for ap in pending if not _port_answers(*ap)]
        if pending:
            time.sleep(0.05)
    if pending:
        raise SystemExit(f"cluster: sshd did not answer on {pending} within {timeout}s")


# --- client-side files -------------------------------------------------------------------------

def _write_client_files(hosts: list[Host], state: Path, slots: int) -> None:
    known = []
    for h in hosts:
        key = (state / h.name / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        names = ",".join([h.name, h.addr] + [f"[{h.addr}]:{p}" for p in SSH_PORTS if p != 22])
        known.append(f"{names} {' '.join(key)}")
    (state / "known_hosts").write_text("\n".join(known) + "\n")
    (state / "authorized_keys").write_text((state / "id_ed25519.pub").read_text())
    blocks = [
        f"Host {h.name}\n  HostName {h.addr}\n  User root\n  Port 22\n"
        f"  IdentityFile {state / 'id_ed25519'}\n  IdentitiesOnly yes\n"
        f"  UserKnownHostsFile {state / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
        f"  LogLevel ERROR\n"
        for h in hosts
    ]
    (state / "ssh_config").write_text("\n".join(blocks))
    (state / "hostfile").write_text("".join(f"{h.name} slots={slots}\n" for h in hosts))


def _write_state(hosts: list[Host], state: Path, shape: LinkShape = LinkShape()) -> dict:
    info = {
        "link": asdict(shape),
        "state_dir": str(state),
        "hosts": [asdict(h) for h in hosts],
        "bridge": BRIDGE,
        "bridge_addr": f"{SUBNET}.1",
        "ssh_ports": list(SSH_PORTS),
        "ssh_config": str(state / "ssh_config"),
        "known_hosts": str(state / "known_hosts"),
        "identity": str(state / "id_ed25519"),
        "hostfile": str(state / "hostfile"),
    }
    (state / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


# --- commands ----------------------------------------------------------------------------------

def up(n_hosts: int, state: Path, slots: int = 2, shape: LinkShape = LinkShape()) -> dict:
    """Build (or complete) a cluster of ``n_hosts``; returns the state.json contents."""
    why = missing_facilities()
    if why:
        raise SystemExit(f"cluster: cannot build a cluster here: {why}")
    hosts = [Host.numbered(k) for k in range(1, n_hosts + 1)]
    state.mkdir(parents=True, exist_ok=True)
    _keygen(state / "id_ed25519", "dslaunch test cluster")
    (state / "authorized_keys").write_text((state / "id_ed25519.pub").read_text())
    _bridge_up()
    _write_etc_netns(hosts)
    for h in hosts:
        _host_net_up(h)
        _shape_link(h, shape)
        _sshd_up(h, state)
    _wait_ssh(hosts)
    _write_client_files(hosts, state, slots)
    return _write_state(hosts, state, shape)


def reshape(state: Path, shape: LinkShape) -> dict:
    """Change the link limits of the running cluster; returns the updated state.json contents."""
    info = json.loads((state / "state.json").read_text())
    hosts = [Host(**h) for h in info["hosts"]]
    for h in hosts:
        _shape_link(h, shape)
    return _write_state(hosts, state, shape)


def set_link(host: str, up: bool) -> None:
    """Plug ``host``'s cable in or out (the root-namespace end of its veth pair), as the fault tests
    do. Plugging it in also flushes every host's neighbour table: an address resolution begun while
    the cable was out fails every connect queued on it with "No route to host", link up or not,
    and the next test on the cluster would meet that. (A flush drops queued packets silently: TCP
    resends them.)"""
    _run("ip", "link", "set", f"{host}v", "up" if up else "down")
    if up:
        for ns in _our_namespaces():
            _run("ip", "-n", ns, "neigh", "flush", "all", check=False)


def _our_namespaces() -> list[str]:
    return [ns for ns in _namespaces() if ns.startswith(f"{PREFIX}node")]


def down(state: Path) -> None:
    """Stop every process in the cluster's namespaces and remove all it made. Idempotent."""
    for ns in _our_namespaces():
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:  # sshd and anything a test left behind inside this host
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)  # deletes its end of the veth pair too
        shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
    for hdir in state.glob(f"{PREFIX}node*"):
        pid = _pid_alive(hdir / "sshd.pid")
        if pid:
            os.kill(pid, signal.SIGKILL)
    if _exists_link(BRIDGE):
        _run("ip", "link", "del", BRIDGE, check=False)
    shutil.rmtree(state, ignore_errors=True)


def status(state: Path) -> dict:
    """What is up right now: namespaces, sshd answering per host."""
    info = json.loads((state / "state.json").read_text()) if (state / "state.json").exists() else {}
    hosts = info.get("hosts", [])
    return {
        "state_dir": str(state),
        "namespaces": _our_namespaces(),
        "bridge": _exists_link(BRIDGE),
        "sshd": {h["name"]: _port_answers(h["addr"], 22) for h in hosts},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "shape"])
    parser.add_argument("--hosts", type=int, default=3, help="number of hosts (up)")
    parser.add_argument("--slots", type=int, default=2, help="slots per host in the hostfile")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--link-rate", default=None, help="each host's link rate (tc units, e.g. 1gbit)")
    parser.add_argument("--link-delay", default=None, help="added delay each way (tc units, e.g. 1ms)")
    args = parser.parse_args(argv)
    shape = LinkShape(args.link_rate, args.link_delay)
    state = args.state_dir or state_dir_default()
    if args.command == "up":
        if not 1 <= args.hosts <= 40:
            parser.error("--hosts must be between 1 and 40")
        print(json.dumps(up(args.hosts, state, args.slots, shape), indent=2))
    elif args.command == "shape":
        print(json.dumps(reshape(state, shape), indent=2))
    elif args.command == "down":
        down(state)
    else:
        print(json.dumps(status(state), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
