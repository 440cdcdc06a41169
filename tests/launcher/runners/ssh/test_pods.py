"""Kubernetes pods simulated on the test cluster's namespace hosts: each host runs ``dslaunch`` with
exactly the variables Kubeflow's operator gives a pod (PET_*), no hostfile, no sshd or MPI used.
The pods form one job; when one pod dies, the other stops with the cause within seconds and a
failing exit code (Kubernetes then restarts the job's pods by its policy)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.launcher.runners.ssh.helpers import ROOT, Lines
from tests.launcher.runners.ssh.test_train import TRAIN, _losses

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _pod(cluster, k: int, port: int, steps: str) -> Lines:
    """Pod ``k`` of 2 on host ``k`` (its network namespace), as the operator starts it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PET_NNODES": "2", "PET_NODE_RANK": str(k),
           "PET_NPROC_PER_NODE": "2", "PET_MASTER_ADDR": cluster.addrs[0], "PET_MASTER_PORT": str(port)}
    train = [*TRAIN[:-1], steps]
    proc = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[k], sys.executable, "-m", "dslaunch.launcher.cli",
                             *train], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    cluster.launched.append(proc)
    return Lines(proc)


@pytest.mark.timeout(150)
def test_two_pods_train_as_one_job_and_a_dead_pod_stops_the_other(cluster, free_port, local_losses_world4):
    pods = [_pod(cluster, k, free_port, "20") for k in range(2)]
    assert [p.finish(120) for p in pods] == [0, 0], pods[1].text("err")[-2000:] + pods[0].text("err")[-2000:]
    got = _losses(pods[0].text("out"))
    assert [s for s, _ in got] == [10, 20] and got[1][1] < got[0][1]
    assert [v for _, v in got] == pytest.approx([v for _, v in local_losses_world4], abs=1e-4)
    assert "Kubernetes pod 1 of 2 (PET_* variables): ranks 2-3 of 4 here" in pods[1].text("err")

    pods = [_pod(cluster, k, free_port, "100000") for k in range(2)]
    pods[0].wait_for(r"\[rank0\] step +10 ", 1, 90)
    os.killpg(pods[1].proc.pid, signal.SIGKILL)  # the pod is gone: its agent and workers with it
    killed = time.monotonic()
    assert pods[0].finish(60) == 1
    assert time.monotonic() - killed < 30
    error = next(line for line in pods[0].text("err").splitlines() if line.startswith("dslaunch: error: "))
    assert f"[{cluster.addrs[1]}]:" in error, error  # gloo names the dead pod's address (its words vary)
    assert cluster.wait_no_job_processes(10) == {}
