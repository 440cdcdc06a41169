"""End-to-end SSH launches on the 3-host test cluster through the ``dslaunch`` command.

Every test checks afterwards (or as its point) that no process of the job is left on any host,
by listing each host's network namespace.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dslaunch.launcher.plan import LaunchConfig, build_job
from dslaunch.launcher.runners.ssh.connect import SSHError
from dslaunch.launcher.runners.ssh.runner import SSHRunner
from tests.launcher.helpers import STOP_SLACK_S
from tests.launcher.runners.hosts import ppid
from tests.launcher.runners.ssh.helpers import ALLREDUCE, FAKE, PREFLIGHT_S, Lines, causes

pytestmark = pytest.mark.cluster



def _alive(pid: int) -> bool:
    """Running (a zombie waiting for this container's init to reap it does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _left_on(cluster, hosts: tuple[str, ...], timeout: float) -> dict[str, list[str]]:
    deadline = time.monotonic() + timeout
    while (left := {h: p for h in hosts if (p := cluster.job_processes(h))}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _assert_clean(cluster, timeout: float = 3.0) -> None:
    left = cluster.wait_no_job_processes(timeout)
    assert not left, f"processes of the job left behind: {left}"


@pytest.mark.timeout(90)
def test_allreduce_on_3_hosts_x_2_workers(cluster, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), ALLREDUCE))
    assert run.finish(80) == 0, run.text("err")
    results = re.findall(r"^(dsl-node\d): \[rank(\d)\] rank (\d)/6 local_rank (\d) host (\S+): "
                         r"all_reduce sum 21 \(expected 21\)$", run.text("out"), re.M)
    assert sorted(int(r[1]) for r in results) == list(range(6))
    for prefix_host, prefix_rank, rank, local_rank, hostname in results:
        assert prefix_rank == rank
        assert prefix_host == hostname == cluster.hosts[int(rank) // 2]  # ranks 0,1 on node1 ...
        assert int(local_rank) == int(rank) % 2
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_env_contract_propagation_and_interface(cluster, tmp_path, free_port):
    (tmp_path / ".dslaunch_env").write_bytes(b"# comment\r\nFROM_FILE=a=b #c\r\n\r\nGLOO_SOCKET_IFNAME=lo\r\n")
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--no_python", "--no_local_rank",
                                 "/bin/sh", "-c", "echo CWD=$(pwd -P); env",
                                 cwd=tmp_path, env={"NCCL_FOO": "bar baz", "UNRELATED": "x"}))
    assert run.finish(30) == 0, run.text("err")
    env: dict[int, dict[str, str]] = {}
    for _, line in run.out:
        m = re.match(r"^(dsl-node\d): \[rank(\d)\] ([A-Z_]+)=(.*)$", line)
        if m:
            assert m.group(1) == cluster.hosts[int(m.group(2)) // 2]
            env.setdefault(int(m.group(2)), {})[m.group(3)] = m.group(4)
    assert sorted(env) == list(range(6))
    for rank, e in env.items():
        node = rank // 2
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"]) == (str(rank), str(rank % 2), "6")
        assert (e["NODE_RANK"], e["CROSS_RANK"], e["CROSS_SIZE"]) == (str(node), str(node), "3")
        assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == (cluster.addrs[0], str(free_port))
        assert e["NCCL_SOCKET_IFNAME"] == "eth0"  # the route to the master inside the host
        assert e["GLOO_SOCKET_IFNAME"] == "lo"  # the user's choice (env file) wins
        assert e["NCCL_FOO"] == "bar baz" and e["FROM_FILE"] == "a=b #c"
        assert "UNRELATED" not in e
        assert e["CWD"] == str(tmp_path.resolve())
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_failing_rank_stops_every_rank_everywhere_after_the_grace_period(cluster, free_port, tmp_path):
    # rank 0 ignores SIGTERM (needs the SIGKILL after the grace period); rank 3 fails with 7.
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--grace_period", "1.0", FAKE,
                                 "r0:ignore_term", f"grandchild={tmp_path}/gc{{rank}}", "print=ready",
                                 "r3:sleep=0.5", "r3:print=failing-now", "r3:exit=7", "hang"))
    run.wait_for(r"\[rank\d\] ready$", 6, 30)
    failed_at = run.wait_for(r"^dsl-node2: \[rank3\] failing-now$", 1, 10)
    code = run.finish(10)
    stopped_in = time.monotonic() - failed_at
    assert code == 7, run.text("err")
    assert re.search(r"rank 3 on dsl-node2 exited with code 7", run.text("err")), run.text("err")
    assert stopped_in < 1.0 + STOP_SLACK_S, f"took {stopped_in:.2f}s to stop the job"  # 2.32 s at load 6-11
    _assert_clean(cluster, timeout=0.5)  # grandchildren included


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_stopping_or_killing_dslaunch_leaves_nothing_on_any_host(cluster, free_port, tmp_path, sig, code):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE,
                                 f"grandchild={tmp_path}/gc{{rank}}", "print=ready", "hang"))
    run.wait_for(r"\[rank\d\] ready$", 6, 30)
    assert all(len(cluster.job_processes(h)) >= 4 for h in cluster.hosts)  # sshd session, agent, workers
    run.proc.send_signal(sig)
    assert run.finish(10) == code, run.text("err")
    _assert_clean(cluster, timeout=3.0)
    grandchildren = [int(p.read_text()) for p in tmp_path.glob("gc*")]
    assert len(grandchildren) == 6
    assert not [pid for pid in grandchildren if _alive(pid)]


@pytest.mark.timeout(60)
def test_busy_master_port_is_a_preflight_error_naming_host_and_port(cluster, free_port):
    listener = subprocess.Popen(
        ["ip", "netns", "exec", cluster.hosts[0], sys.executable, "-c",
         f"import socket,time; s=socket.socket(); s.bind(('', {free_port})); s.listen(); print('up', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "up"
        start = time.monotonic()
        run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, "print=started"))
        code = run.finish(20)
        elapsed = time.monotonic() - start
    finally:
        listener.kill()
        listener.wait()
    err = run.text("err")
    assert code != 0 and "started" not in run.text("out")
    assert cluster.hosts[0] in err and str(free_port) in err and "in use" in err, err
    assert elapsed < PREFLIGHT_S
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_unreachable_host_and_unknown_host_key_through_the_cli(cluster, tmp_path, free_port):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{cluster.hosts[0]} slots=1\n10.213.7.99 slots=1\n")
    start = time.monotonic()
    run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, hostfile=str(hostfile)))
    assert run.finish(20) != 0
    assert time.monotonic() - start < PREFLIGHT_S
    assert re.search(r"10\.213\.7\.99: .*(unreachable|timed out)", run.text("err")), run.text("err")

    empty = tmp_path / "known_hosts"
    empty.write_text("")
    args = ("--master_port", str(free_port), "--launcher_args",
            f"-F {cluster.ssh_config} -o UserKnownHostsFile={empty}")
    run = Lines(cluster.dslaunch(*args, FAKE, "print=ran"))
    assert run.finish(20) != 0
    assert "unknown host key" in run.text("err") and "--ssh_accept_new_host_keys" in run.text("err")
    run = Lines(cluster.dslaunch(*args, "--ssh_accept_new_host_keys", FAKE, "print=ran"))
    assert run.finish(30) == 0, run.text("err")
    assert len(re.findall(r"\[rank\d\] ran$", run.text("out"), re.M)) == 6
    assert len(empty.read_text().splitlines()) == 3  # the three keys were recorded
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_missing_interpreter_names_every_host(cluster, free_port):
    cfg = LaunchConfig(user_script=FAKE, hostfile=cluster.hostfile, hostfile_explicit=True,
                       master_port=free_port, launcher_args=cluster.launcher_args)
    job = replace(build_job(cfg, detect=lambda: None).job, python="/nonexistent/venv/bin/python")
    start = time.monotonic()
    with pytest.raises(SSHError) as err:
        SSHRunner().start(job)
    assert causes(err.value) == {h: "interpreter" for h in cluster.hosts}
    assert "/nonexistent/venv/bin/python not found" in str(err.value)
    assert time.monotonic() - start < PREFLIGHT_S
    _assert_clean(cluster)


def test_dry_run_shows_per_host_command_and_env(cluster, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--dry-run", FAKE, "a b"))
    assert run.finish(20) == 0, run.text("err")
    out = run.text("out")
    for addr in cluster.addrs:
        assert f"ssh root@{addr} 'exec {sys.executable} -m dslaunch.launcher.agent.bootstrap " in out
    assert f"MASTER_ADDR={cluster.addrs[0]}" in out and "NODE_RANK=2" in out
    assert f"{FAKE} --local_rank=1 'a b'" in out
    assert not any(cluster.job_processes(h) for h in cluster.hosts)


@pytest.mark.timeout(90)
def test_host_link_loss_fails_the_job_and_the_host_cleans_up(cluster, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), FAKE, "print=ready", "hang"))
    run.wait_for(r"\[rank\d\] ready$", 6, 30)
    with cluster.link_cut(cluster.hosts[1]):
        start = time.monotonic()
        assert run.finish(20) == 255
        assert time.monotonic() - start < 12  # TCP keepalive + TCP_USER_TIMEOUT on the client socket
        assert f"lost the SSH connection to {cluster.hosts[1]}" in run.text("err")
        assert _left_on(cluster, (cluster.hosts[0], cluster.hosts[2]), timeout=2) == {}
        # The cut-off host: its sshd drops the silent client, the agent sees EOF, workers die.
        assert _left_on(cluster, (cluster.hosts[1],), timeout=25) == {}


def _agent_and_its_sshd(cluster, host: str) -> tuple[int, int]:
    """The node agent's pid on ``host`` and that of the sshd process serving its connection."""
    procs = {int(p.split()[0]): p for p in cluster.job_processes(host)}
    sshd = [pid for pid, args in procs.items() if args.endswith("sshd: root@notty")]
    agent = [pid for pid, args in procs.items() if "agent.bootstrap" in args and ppid(pid) in sshd]
    assert len(agent) == 1, procs  # (its watchdog is a fork with the same command line)
    return agent[0], ppid(agent[0])


@pytest.mark.timeout(60)
def test_a_frozen_agent_is_killed_over_ssh(cluster, free_port):
    """An agent that cannot react to EOF (SIGSTOPped) is SIGKILLed over a second channel."""
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--grace_period", "0.5", FAKE,
                                 "print=ready", "hang"))
    run.wait_for(r"\[rank\d\] ready$", 6, 30)
    agent, _ = _agent_and_its_sshd(cluster, cluster.hosts[1])
    os.kill(agent, signal.SIGSTOP)
    start = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(10) == 143, run.text("err")
    # killed over SSH at grace + 0.3 s (~1 s idle, 3.8 s at load 30 here), not given up on (grace + 5.3 s)
    assert time.monotonic() - start < 5.0
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_a_frozen_agent_behind_a_slow_sshd_is_still_killed(cluster, free_port):
    """On a busy host its sshd may take seconds to open the kill's channel: the kill waits for it
    (within the give-up), instead of dropping the connection and leaving the stopped agent and its
    workers running on the host."""
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--grace_period", "0.5", FAKE,
                                 "print=ready", "hang"))
    run.wait_for(r"\[rank\d\] ready$", 6, 30)
    agent, sshd = _agent_and_its_sshd(cluster, cluster.hosts[1])
    os.kill(agent, signal.SIGSTOP)
    os.kill(sshd, signal.SIGSTOP)  # the busy host, staged: its sshd answers nothing for a while
    try:
        run.proc.send_signal(signal.SIGTERM)
        time.sleep(2.5)  # the kill, due at grace + 0.3 s, waits on the channel's opening meanwhile
    finally:
        os.kill(sshd, signal.SIGCONT)
    assert run.finish(10) == 143, run.text("err")
    _assert_clean(cluster)


@pytest.mark.timeout(60)
def test_ssh_port_flag_overrides_the_config(cluster, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--ssh_port", "2222", FAKE, "print=ran"))
    assert run.finish(30) == 0, run.text("err")
    assert len(re.findall(r"\[rank\d\] ran$", run.text("out"), re.M)) == 6
    run = Lines(cluster.dslaunch("--master_port", str(free_port), "--ssh_port", "2223", FAKE, "print=ran"))
    assert run.finish(30) != 0
    for host, addr in zip(cluster.hosts, cluster.addrs, strict=True):
        assert f"{host}: connection refused by {addr} port 2223" in run.text("err")
    _assert_clean(cluster)
