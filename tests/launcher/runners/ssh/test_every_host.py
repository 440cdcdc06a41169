"""``dslaunch ssh`` (DeepSpeed's ``ds_ssh``) on the namespace hosts: each host's lines prefixed with
its name, the largest exit code, and a host that cannot be reached named while the others run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launcher.runners.ssh.conftest import ROOT, Cluster

# Each host answers with its own network namespace's name (where the command really ran), prints one
# line on stderr, and exits with its host number (dsl-node2 -> 2); the hostname is the machine's.
_COMMAND = "n=$(ip netns identify); echo out $n; echo err >&2; exit $((${n#*node} - 1))"


def _ssh(cluster: Cluster, *args: str, ssh_options: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "ssh", "-f", cluster.hostfile,
                           "--launcher_args", f"{cluster.launcher_args} {ssh_options}", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.timeout(90)
def test_every_host_runs_the_command_once(cluster: Cluster) -> None:
    proc = _ssh(cluster, _COMMAND)
    assert sorted(proc.stdout.splitlines()) == [f"{h}: out {h}" for h in cluster.hosts], proc.stdout + proc.stderr
    err = proc.stderr.splitlines()
    assert sorted(line for line in err if line.endswith(": err")) == [f"{h}: err" for h in cluster.hosts], err
    # the hosts exit 0, 1, 2: the command exits with the largest and names the failed hosts
    assert proc.returncode == len(cluster.hosts) - 1, proc.stderr
    failed = ", ".join(f"{h} (exit {k})" for k, h in enumerate(cluster.hosts) if k)
    assert err[-1] == f"dslaunch ssh: {len(cluster.hosts) - 1} of {len(cluster.hosts)} host(s) failed: {failed}", err
    ok = _ssh(cluster, "--include", cluster.hosts[0], _COMMAND)  # the host that exits 0
    assert ok.returncode == 0 and ok.stdout == f"{cluster.hosts[0]}: out {cluster.hosts[0]}\n", ok.stdout + ok.stderr


@pytest.mark.timeout(90)
def test_an_unreachable_host_is_named_and_the_others_run(cluster: Cluster) -> None:
    cut = cluster.hosts[1]
    with cluster.link_cut(cut):
        proc = _ssh(cluster, "true", ssh_options="-o ConnectTimeout=3")
    assert proc.returncode == 255, proc.stderr
    lines = proc.stderr.splitlines()
    assert any(line.startswith(f"{cut}: dslaunch: ") for line in lines), lines
    assert lines[-1] == f"dslaunch ssh: 1 of {len(cluster.hosts)} host(s) failed: {cut} (exit 255)", lines
