"""Elastic training on the SSH test cluster: one host lost mid-run (every process on it killed,
its link cut, or every process on it frozen), the job restarts without that host and finishes at
the smaller world size from the resharded checkpoint.

Run under ``flock /tmp/dslaunch-cluster.lock`` (the cluster is shared)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import time
from collections.abc import Iterator

import pytest

from dslaunch.launcher.monitor.gang import HOST_SILENT_S
from tests.launcher.runners.hosts import descends
from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


def _signal_host(cluster, host: str, *sigs: int) -> list[str]:
    """Send each of ``sigs`` to every process the job has on ``host``: its sshd sessions and what
    they started (other daemons that may live in the namespace, e.g. a SLURM test bed's, are left
    alone)."""
    listener = cluster.sshd_pid(host)
    procs = [p for p in cluster.job_processes(host) if descends(int(p.split()[0]), listener)]
    for sig in sigs:
        for pid in (int(p.split()[0]) for p in procs):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return procs


@contextlib.contextmanager
def _kill_host(cluster, host: str) -> Iterator[None]:
    """Freeze, then SIGKILL, every process of ``host``: none of them can report."""
    assert _signal_host(cluster, host, signal.SIGSTOP, signal.SIGKILL)
    yield


@contextlib.contextmanager
def _cut_link(cluster, host: str) -> Iterator[None]:
    """``host``'s cable out (in again afterwards, whatever happened)."""
    with cluster.link_cut(host):
        yield


@contextlib.contextmanager
def _freeze_host(cluster, host: str) -> Iterator[None]:
    """SIGSTOP every process of ``host`` (agent, workers, its sshd session): the connection stays
    up, nothing is sent. SIGCONT afterwards, so that they see the job gone and exit."""
    assert _signal_host(cluster, host, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_host(cluster, host, signal.SIGCONT)


def _processes(cluster) -> set[str]:
    return {f"{h}: {p}" for h in cluster.hosts for p in cluster.job_processes(h)}


def _failure(logs) -> dict:
    (job,) = glob.glob(str(logs / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        return next(e for e in map(json.loads, f) if e["kind"] == "failure")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", [_kill_host, _cut_link, _freeze_host], ids=["killed", "link-cut", "frozen"])
def test_a_lost_host_is_left_out_and_the_job_finishes_smaller(cluster, free_port, tmp_path, fault):
    first, second = cluster.hosts[:2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{first} slots=1\n{second} slots=1\n")
    ckpt, out, logs = tmp_path / "ckpt", tmp_path / "final.pt", tmp_path / "logs"
    before = _processes(cluster)  # daemons living in the namespaces (a SLURM test bed's) are not the job's
    run = Lines(cluster.dslaunch(
        "--master_port", str(free_port), "--max_restarts", "1", "--elastic_training", "--min_elastic_nodes", "1",
        "--resume_from", str(ckpt), "--log_dir", str(logs), SCRIPT, "--steps", "12", "--save_every", "3",
        "--sleep", "0.3", "--ckpt", str(ckpt), "--out", str(out), hostfile=str(hostfile)))
    run.wait_for(r"rank1 step=4", 1, timeout=90)  # the checkpoint of step 3 is published
    faulted_at = time.time()
    with fault(cluster, second):
        assert run.finish(150) == 0, run.text("err")[-3000:]
    err, stdout = run.text("err"), run.text("out")
    assert re.search(rf"dslaunch: restart 1 of 1 in 1 s after .*; without lost host\(s\) {second}$", err, re.M), err
    assert f"dslaunch: hosts now {first} (world size 1; left: {second}, joined: -)" in err, err
    resumed = [int(s) for s in re.findall(r"rank0 world=1 resumed_at=(\d+)", stdout)]
    assert len(resumed) == 1 and resumed[0] >= 3, stdout
    assert "rank1 world=" not in stdout.split("world=1 resumed_at")[-1]  # no rank 1 after the restart
    assert out.exists()
    failure = _failure(logs)
    if fault is not _kill_host:  # (a killed host may show first as its rank's signal)
        assert (failure["cause"], failure["host"]) == ("host_lost", second), failure
    if fault is _freeze_host:  # its connection never drops: only its silence tells
        assert "no news from its agent for " in failure["message"], failure
        assert failure["detected_t"] - faulted_at < HOST_SILENT_S + 3, failure
    assert failure["detected_t"] - faulted_at < 10, failure  # the target for host loss
    deadline = time.monotonic() + 25
    while (left := _processes(cluster) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left
