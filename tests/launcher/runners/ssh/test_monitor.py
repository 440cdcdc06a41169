"""The monitor across hosts of the SSH test cluster: heartbeats and stacks over the agents' wire
lines, a hang named on the right host, a host whose processes all die, a host whose link is cut.

Run under ``flock /tmp/dslaunch-cluster.lock`` (the cluster is shared)."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

import pytest

from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = pytest.mark.cluster

LOOP = str(ROOT / "tests" / "launcher" / "bin" / "train_loop.py")


def _start(cluster, tmp_path, free_port, *flags: str, **env: str) -> Lines:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{cluster.hosts[0]} slots=1\n{cluster.hosts[1]} slots=1\n")
    return Lines(cluster.dslaunch("--master_port", str(free_port), "--log_dir", str(tmp_path / "logs"), *flags,
                                  LOOP, hostfile=str(hostfile), env=env))


def _events(tmp_path) -> list[dict]:
    (job,) = glob.glob(str(tmp_path / "logs" / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _wait_up(run: Lines, tmp_path, timeout: float = 60) -> dict[int, int]:
    """rank -> pid once both ranks beat (ranks_up in the log); then a few steps."""
    run.wait_for(r"\] pid \d \d+$", 2, timeout)
    deadline = time.monotonic() + timeout
    while not any(e["kind"] == "ranks_up" for e in _events(tmp_path)):
        assert time.monotonic() < deadline and run.proc.poll() is None, run.text("err")
        time.sleep(0.1)
    time.sleep(1.0)
    return {int(r): int(p) for r, p in (line.split()[-2:] for _, line in run.out if "] pid " in line)}


def _failure(tmp_path) -> dict:
    (failure,) = [e for e in _events(tmp_path) if e["kind"] == "failure"]
    return failure


@pytest.mark.timeout(120)
def test_a_stopped_rank_on_another_host_is_named_with_stacks_over_the_wire(cluster, tmp_path, free_port):
    run = _start(cluster, tmp_path, free_port, "--hang_timeout", "5")
    pids = _wait_up(run, tmp_path)
    os.kill(pids[1], signal.SIGSTOP)  # one PID space: the rank on the second host
    start = time.monotonic()
    code = run.finish(60)
    assert code == 124, run.text("err")
    assert 4.5 < time.monotonic() - start < 30
    assert f"rank 1 on {cluster.hosts[1]} hung at step " in run.text("err")
    (stacks,) = [e for e in _events(tmp_path) if e["kind"] == "stacks"]
    assert stacks["behind"] == [1] and stacks["ranks"]["1"]["stopped"]
    for rank in ("0", "1"):  # both hosts answered with their stacks
        assert "train_loop.py" in open(stacks["ranks"][rank]["file"]).read()
    assert not cluster.wait_no_job_processes(5)


@pytest.mark.timeout(120)
def test_every_process_of_a_host_killed_is_a_lost_host_or_its_ranks_signal(cluster, tmp_path, free_port):
    run = _start(cluster, tmp_path, free_port)
    _wait_up(run, tmp_path)
    victim = cluster.hosts[1]
    killed_at = time.time()
    for entry in cluster.job_processes(victim):
        try:
            os.kill(int(entry.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    code = run.finish(30)
    failure = _failure(tmp_path)
    assert failure["host"] == victim, failure
    assert (failure["cause"], code) in {("host_lost", 255), ("signal", 137)}, (failure, run.text("err"))
    assert failure["detected_t"] - killed_at < 5
    assert not cluster.wait_no_job_processes(5)


@pytest.mark.timeout(120)
def test_a_cut_link_is_a_lost_host_within_seconds(cluster, tmp_path, free_port):
    run = _start(cluster, tmp_path, free_port)
    _wait_up(run, tmp_path)
    with cluster.link_cut(cluster.hosts[1]) as cut_at:
        code = run.finish(40)
    assert code == 255, run.text("err")
    failure = _failure(tmp_path)
    assert (failure["cause"], failure["host"], failure["exit_code"]) == ("host_lost", cluster.hosts[1], 255)
    assert failure["detected_t"] - cut_at < 12  # TCP keepalive + TCP_USER_TIMEOUT on the SSH socket
    assert failure["fault_t"] <= cut_at + 1  # the last news from that host came before the cut
    assert f"lost host {cluster.hosts[1]}" in run.text("err")
    assert not cluster.wait_no_job_processes(25)
