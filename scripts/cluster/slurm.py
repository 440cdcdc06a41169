#!/usr/bin/env python3
"""A real SLURM on the test cluster's hosts: ``slurm.py up|down|status [--hosts K]``.

``up`` builds (or completes) the namespace cluster of ``cluster.py`` and adds Debian's slurm-wlm
22.05 to it: ``munged`` and ``slurmctld`` in the root namespace (reached by the hosts at the
bridge address), and one ``slurmd -N dsl-nodeK`` per host, started inside that host's network
namespace with ``nsenter --net`` (``ip netns exec`` breaks slurmd's cgroup check) under
``unshare --uts --mount`` so that its hostname is the host's and ``/etc/hosts`` there is the
cluster's (jobs resolve ``dsl-nodeK`` as on a real cluster). ``proctrack/linuxproc`` and
``task/none``: no cgroups needed. One partition ``debug`` with every host, ``CPUs=2`` each.

State (default ``/tmp/dslaunch-slurm`` or ``$DSLAUNCH_SLURM_DIR``): ``slurm.conf`` (point
``SLURM_CONF`` at it), the munge key and socket, spool and state directories, logs and
``state.json``. Commands need ``SLURM_CONF=<state>/slurm.conf`` in their environment
(``env`` prints it). Own ports (16817/16818), so a system SLURM is left alone.

``up`` and ``down`` are idempotent; ``up`` restarts whatever is not running (e.g. the slurmds after
the namespace cluster was rebuilt) and waits until every node is idle. Standard library only.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402  (the sibling script: namespaces and sshd)

DEFAULT_STATE_DIR = "/tmp/dslaunch-slurm"
CTLD_PORT, SLURMD_PORT = 16817, 16818
PARTITION = "debug"
CPUS = 2
MUNGED, SLURMCTLD, SLURMD = "/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd"


def state_dir_default() -> Path:
    return Path(os.environ.get("DSLAUNCH_SLURM_DIR", DEFAULT_STATE_DIR))


def missing_facilities() -> str | None:
    """Why SLURM cannot run here, or None when it can (the namespace cluster's needs included)."""
    why = cluster.missing_facilities()
    if why:
        return why
    for path in (MUNGED, SLURMCTLD, SLURMD, shutil.which("nsenter") or "/usr/bin/nsenter"):
        if not os.access(path, os.X_OK):
            return f"{path} is not installed (slurm-wlm, munge; run scripts/system_deps.sh)"
    return None


def _pid_alive(pidfile: Path, name: str) -> int | None:
    """The pid in ``pidfile`` when that process is alive and runs ``name``."""
    try:
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError, IndexError):
        return None
    return pid if name.encode() in cmdline else None


def _conf(state: Path, hosts: list[cluster.Host], gateway: str) -> str:
    names = f"{cluster.PREFIX}node[1-{len(hosts)}]" if len(hosts) > 1 else hosts[0].name
    return "\n".join([
        "ClusterName=dsltest",
        f"SlurmctldHost={socket.gethostname()}({gateway})",
        f"SlurmctldPort={CTLD_PORT}",
        f"SlurmdPort={SLURMD_PORT}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={state / 'munge' / 'munge.socket'}",
        f"StateSaveLocation={state / 'ctld'}",
        f"SlurmdSpoolDir={state / 'spool' / '%n'}",
        f"SlurmctldPidFile={state / 'slurmctld.pid'}",
        f"SlurmdPidFile={state / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={state / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={state / 'log' / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "ReturnToService=2",
        "SlurmdTimeout=30",
        "KillWait=5",
        "MinJobAge=300",
        "SchedulerParameters=sched_interval=2",
        f"NodeName={names} NodeAddr={','.join(h.addr for h in hosts)} CPUs={CPUS} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _munge_up(state: Path) -> None:
    sock_dir, key_dir = state / "munge", state / "munge-key"
    sock_dir.mkdir(parents=True, exist_ok=True)
    key_dir.mkdir(parents=True, exist_ok=True)
    sock_dir.chmod(0o755)  # munged refuses a socket whose directories are not searchable by all
    key_dir.chmod(0o700)
    key = key_dir / "munge.key"
    if not key.exists():
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
    if _pid_alive(sock_dir / "munged.pid", "munged"):
        return
    cluster._run(MUNGED, "--force", f"--socket={sock_dir / 'munge.socket'}", f"--key-file={key}",
                 f"--pid-file={sock_dir / 'munged.pid'}", f"--log-file={state / 'log' / 'munged.log'}",
                 f"--seed-file={key_dir / 'munged.seed'}")


def _env(state: Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}


def _slurmctld_up(state: Path, reconfigured: bool) -> None:
    pid = _pid_alive(state / "slurmctld.pid", "slurmctld")
    if pid and not reconfigured:
        return
    if pid:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
    # -i: ignore state from an older configuration (node list, addresses) instead of refusing it.
    cluster._run(SLURMCTLD, "-i", "-f", str(state / "slurm.conf"))


def _wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)


def _slurmd_up(state: Path, host: cluster.Host, reconfigured: bool) -> None:
    pidfile = state / f"slurmd-{host.name}.pid"
    pid = _pid_alive(pidfile, "slurmd")
    if pid and not reconfigured:
        return
    if pid:
        os.kill(pid, signal.SIGTERM)
        _wait_gone(pid)
    (state / "spool" / host.name).mkdir(parents=True, exist_ok=True)
    inner = (f"hostname {host.name} && mount --bind /etc/netns/{host.name}/hosts /etc/hosts && "
             f"exec {SLURMD} -f {state / 'slurm.conf'} -N {host.name}")
    cluster._run("nsenter", f"--net=/run/netns/{host.name}", "unshare", "--uts", "--mount",
                 "--propagation", "private", "sh", "-c", inner)


def _node_states(state: Path) -> dict[str, str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                         env=_env(state), timeout=10).stdout
    return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)


def _wait_idle(state: Path, names: list[str], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            seen = _node_states(state)
        except subprocess.TimeoutExpired:
            seen = {}
        if all(seen.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in names):
            return
        down = [n for n in names if seen.get(n, "").rstrip("*") in ("down", "drain", "drng", "fail")]
        if down:  # e.g. a node that went away while a job ran: it is back now
            subprocess.run(["scontrol", "update", f"NodeName={','.join(down)}", "State=RESUME"],
                           capture_output=True, env=_env(state), timeout=10)
        time.sleep(0.3)
    raise SystemExit(f"slurm: nodes not idle within {timeout:g}s: {seen} (logs in {state / 'log'})")


def up(n_hosts: int, state: Path) -> dict:
    """Bring up the namespace cluster and SLURM on it; returns ``state.json``'s contents."""
    why = missing_facilities()
    if why:
        raise SystemExit(f"slurm: cannot run SLURM here: {why}")
    info = cluster.up(n_hosts, cluster.state_dir_default())
    hosts = [cluster.Host(h["name"], h["addr"], h["iface"]) for h in info["hosts"]]
    for sub in ("log", "ctld", "spool"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    conf = state / "slurm.conf"
    text = _conf(state, hosts, info["bridge_addr"])
    reconfigured = conf.exists() and conf.read_text() != text
    conf.write_text(text)
    _munge_up(state)
    _slurmctld_up(state, reconfigured)
    for h in hosts:
        _slurmd_up(state, h, reconfigured)
    _wait_idle(state, [h.name for h in hosts])
    result = {"state_dir": str(state), "slurm_conf": str(conf), "partition": PARTITION, "cpus": CPUS,
              "hosts": [h.name for h in hosts], "addrs": [h.addr for h in hosts], "cluster": info}
    (state / "state.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def down(state: Path) -> None:
    """Stop every SLURM daemon this script started and remove its state. Idempotent."""
    for pidfile in sorted(state.glob("slurmd-*.pid")):
        if pid := _pid_alive(pidfile, "slurmd"):
            os.kill(pid, signal.SIGKILL)  # its job steps die with it (linuxproc tracks them by parent)
    for pidfile, name in ((state / "slurmctld.pid", "slurmctld"), (state / "munge" / "munged.pid", "munged")):
        if pid := _pid_alive(pidfile, name):
            os.kill(pid, signal.SIGTERM)
            _wait_gone(pid)
    shutil.rmtree(state, ignore_errors=True)


def status(state: Path) -> dict:
    alive = {"munged": bool(_pid_alive(state / "munge" / "munged.pid", "munged")),
             "slurmctld": bool(_pid_alive(state / "slurmctld.pid", "slurmctld"))}
    nodes = _node_states(state) if alive["slurmctld"] else {}
    return {"state_dir": str(state), **alive, "nodes": nodes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "env"])
    parser.add_argument("--hosts", type=int, default=3, help="number of hosts (up)")
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    state = args.state_dir or state_dir_default()
    if args.command == "up":
        if not 1 <= args.hosts <= 40:
            parser.error("--hosts must be between 1 and 40")
        print(json.dumps(up(args.hosts, state), indent=2))
    elif args.command == "down":
        down(state)
    elif args.command == "env":
        print(f"export SLURM_CONF={state / 'slurm.conf'}")
    else:
        print(json.dumps(status(state), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
