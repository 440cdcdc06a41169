"""Elastic training on the SSH test cluster: every process of one host killed mid-run, the job
restarts without that host and finishes at the smaller world size from the resharded checkpoint."""

from __future__ import annotations

import os
import re
import signal

import pytest

from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


def _kill_host(cluster, host: str) -> list[str]:
    """Freeze, then SIGKILL, every process of ``host`` but its sshd: none of them can report."""
    procs = cluster.job_processes(host)
    pids = [int(p.split()[0]) for p in procs]
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return procs


@pytest.mark.timeout(200)
def test_a_lost_host_is_left_out_and_the_job_finishes_smaller(cluster, free_port, tmp_path):
    first, second = cluster.hosts[:2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(f"{first} slots=1\n{second} slots=1\n")
    ckpt, out = tmp_path / "ckpt", tmp_path / "final.pt"
    run = Lines(cluster.dslaunch(
        "--master_port", str(free_port), "--max_restarts", "1", "--elastic_training", "--min_elastic_nodes", "1",
        "--resume_from", str(ckpt), SCRIPT, "--steps", "12", "--save_every", "3", "--sleep", "0.3",
        "--ckpt", str(ckpt), "--out", str(out), hostfile=str(hostfile)))
    run.wait_for(r"rank1 step=4", 1, timeout=90)  # the checkpoint of step 3 is published
    assert _kill_host(cluster, second)
    assert run.finish(150) == 0, run.text("err")[-3000:]
    err, stdout = run.text("err"), run.text("out")
    assert re.search(rf"dslaunch: restart 1 of 1 in 1 s after .*; without lost host\(s\) {second}$", err, re.M), err
    assert f"dslaunch: hosts now {first} (world size 1; left: {second}, joined: -)" in err, err
    resumed = [int(s) for s in re.findall(r"rank0 world=1 resumed_at=(\d+)", stdout)]
    assert len(resumed) == 1 and resumed[0] >= 3, stdout
    assert "rank1 world=" not in stdout.split("world=1 resumed_at")[-1]  # no rank 1 after the restart
    assert out.exists()
    assert cluster.wait_no_job_processes(5) == {}
