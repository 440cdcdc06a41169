"""``dslaunch --dry-run`` with remote hosts: the real command line, no network, no cluster needed."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
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
        assert remote[:4] == ["exec", sys.executable, "-m", "dslaunch.launcher.agent.bootstrap"]
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


def _two_hosts(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host nodeA\n  HostName 10.99.0.5\n  Port 2201\nHost nodeB\n  HostName 10.99.0.6\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    return ["-H", str(hostfile), "--launcher_args", f"-F {config} -l 'o*k'", "--dry-run"]


def test_dry_run_lines_are_exactly_what_a_shell_needs(tmp_path):
    """Each printed line, pasted into a shell, runs that command: names and values included."""
    env = {"NCCL;touch pwned;X": "1", "NCCL_DEBUG": "a b'c $(touch pwned2)"}
    r = run_dslaunch([*_two_hosts(tmp_path), FAKE, "argv"], cwd=str(tmp_path), **env)
    assert r.returncode == 0, r.stderr
    ssh = [shlex.split(line) for line in r.stdout.splitlines() if line.startswith("ssh ")]
    assert [w[:-1] for w in ssh] == [["ssh", "-p", "2201", "o*k@10.99.0.5"], ["ssh", "o*k@10.99.0.6"]]
    workers = [line for line in r.stdout.splitlines() if FAKE in line and not line.startswith("ssh ")]
    assert len(workers) == 2
    for line in workers:
        words = shlex.split(line)
        assert "NCCL_DEBUG=a b'c $(touch pwned2)" in words
        assert words[words.index("env") + 1] == "NCCL;touch pwned;X=1"
        # Run it (the fake worker prints its arguments): nothing but the worker runs.
        run = subprocess.run(["bash", "-c", line], cwd=tmp_path, capture_output=True, text=True, timeout=20)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout)[0].startswith("--local_rank=")
    assert not list(tmp_path.glob("pwned*"))


@pytest.mark.parametrize("args, words", [
    (["--launcher_args", "-l 'root;id'"], "--launcher_args -l/-o User: 'root;id' is not a user name ssh accepts"),
    (["--launcher_args", "-l -oProxyCommand=x"], "--launcher_args -l/-o User: '-oProxyCommand=x' is not a user"),
    (["--launcher_args", "-o 'User=a|b'"], "--launcher_args -l/-o User: 'a|b' is not a user name ssh accepts"),
])
def test_an_ssh_user_a_shell_would_misread_is_refused(tmp_path, args, words):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=1\n")
    r = run_dslaunch(["-H", str(hostfile), *args, "--dry-run", FAKE], cwd=str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"dslaunch: error: {words}") and r.stderr.count("\n") == 1, r.stderr


def test_an_ssh_config_hostname_that_is_no_host_is_refused(tmp_path):
    config = tmp_path / "ssh_config"
    config.write_text("Host nodeA\n  HostName -oProxyCommand=touch\n")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=1\n")
    r = run_dslaunch(["-H", str(hostfile), "--launcher_args", f"-F {config}", "--dry-run", FAKE], cwd=str(tmp_path))
    assert r.returncode == 2 and r.stderr == ("dslaunch: error: ssh config HostName for nodeA: '-oProxyCommand=touch': "
                                              "expected labels of letters, digits, '-' and '_' separated by '.', not "
                                              "starting or ending with '-'\n")


def test_venv_script_is_sourced_before_the_agent_as_one_word(tmp_path):
    script = "/opt/my env/act'ivate"  # a space and a quote: still one word for the remote shell
    r = run_dslaunch([*_two_hosts(tmp_path), "--venv_script", script, FAKE], cwd=str(tmp_path))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    remote = [shlex.split(shlex.split(line)[-1]) for line in r.stdout.splitlines() if line.startswith("ssh ")]
    assert len(remote) == 2
    for words in remote:  # POSIX `.` (a host whose login shell is sh has no `source`), then exec
        assert words[:5] == [".", script, "&&", "exec", sys.executable], words
    local = run_dslaunch(["--venv_script", script, "--num_gpus", "1", "--dry-run", FAKE], cwd=str(tmp_path))
    assert local.returncode == 0 and f"--venv_script {script} is sourced by the ssh launcher only" in local.stderr
