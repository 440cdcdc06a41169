"""``dslaunch --dry-run`` with remote hosts: the real command line, no network, no cluster needed."""

from __future__ import annotations

import json
import re
import shlex
import socket
import sys
import time

import pytest

from tests.launcher.helpers import FAKE, run_dslaunch

pytestmark = pytest.mark.timeout(30)

PLACEHOLDER = "'<interface routing to MASTER_ADDR, found at launch>'"


def test_dry_run_prints_each_hosts_ssh_command_and_env_without_connecting(tmp_path):
    # nodeB is a listener on this machine that would see any connection attempt.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port_b = listener.getsockname()[1]
    config = tmp_path / "ssh_config"
    config.write_text(f"Host nodeA\n  HostName 10.99.0.5\n  Port 2201\n  User alice\n"
                      f"Host nodeB\n  HostName 127.0.0.1\n  Port {port_b}\n  User bob\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=2\nnodeB slots=1\n")
    start = time.monotonic()
    r = run_dslaunch(["-H", str(hostfile), "--launcher_args", f"-F {config}", "--master_port", "4321",
                      "--dry-run", FAKE, "a b"], cwd=str(tmp_path), NCCL_SOCKET_IFNAME="ib0", NCCL_DEBUG="INFO")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert time.monotonic() - start < 15
    with pytest.raises(BlockingIOError):
        listener.accept()  # nobody knocked
    listener.close()

    ssh = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("ssh ")]
    assert [words[:-1] for words in ssh] == [["ssh", "-p", "2201", "alice@10.99.0.5"],
                                             ["ssh", "-p", str(port_b), "bob@127.0.0.1"]]
    for words, is_master in zip(ssh, (True, False), strict=True):
        remote = shlex.split(words[-1])  # what the remote login shell runs
        assert remote[:4] == ["exec", sys.executable, "-m", "dslaunch.launcher.ssh_probe"]
        assert json.loads(remote[4]) == {"cwd": str(tmp_path), "master_addr": "10.99.0.5", "master_port": 4321,
                                         "is_master": is_master, "script": FAKE}

    workers = [line for line in r.stdout.splitlines() if FAKE in line and not line.startswith("ssh ")]
    assert len(workers) == 3
    for rank, line in enumerate(workers):
        node, local = (0, rank) if rank < 2 else (1, 0)
        env = dict(re.findall(r"(?:^| )([A-Z_]+)=('[^']*'|\S+)", line))
        assert env["MASTER_ADDR"] == "10.99.0.5" and env["MASTER_PORT"] == "4321"
        assert (env["RANK"], env["LOCAL_RANK"], env["NODE_RANK"], env["WORLD_SIZE"]) == (
            str(rank), str(local), str(node), "3")
        assert env["GLOO_SOCKET_IFNAME"] == PLACEHOLDER  # found by each host's probe at launch
        assert env["NCCL_SOCKET_IFNAME"] == "ib0" and env["NCCL_DEBUG"] == "INFO"  # the user's values travel
        assert line.endswith(f"{FAKE} --local_rank={local} 'a b'")
    assert "# node 0: nodeA (2 workers)" in r.stdout and "# node 1: nodeB (1 workers)" in r.stdout
    assert r.stdout.count(f"cd {tmp_path}\n") == 2
