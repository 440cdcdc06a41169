"""Elastic training on the test SLURM: a node lost during a ``--launcher slurm`` job (its node agent
and workers killed, or frozen), the monitor leaves it out, the job finishes at the smaller world
size from the resharded checkpoint and the allocation ends with exit 0.

Only the job's processes under that node's ``slurmstepd`` are hit, never slurmd: SLURM itself still
counts the node as up, so what finds the loss is dslaunch's monitor (srun ending without the agent's
status, or the node's silence). Run under ``flock /tmp/dslaunch-cluster.lock``.
"""

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
from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SCRIPT = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


def _signal_node(slurm, host: str, *sigs: int) -> list[int]:
    """Send each of ``sigs`` to every process of the job's steps on ``host``."""
    pids = slurm.step_processes(host)
    for sig in sigs:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    return pids


@contextlib.contextmanager
def _kill_node(slurm, host: str) -> Iterator[None]:
    """Freeze, then SIGKILL, the node agent and its workers: none of them can report; srun sees
    the task killed."""
    assert _signal_node(slurm, host, signal.SIGSTOP, signal.SIGKILL)
    yield


@contextlib.contextmanager
def _freeze_node(slurm, host: str) -> Iterator[None]:
    """SIGSTOP the node agent and its workers: srun and its step stay up, nothing is said. SIGCONT
    afterwards (SLURM will have killed them when the step was cancelled)."""
    pids = _signal_node(slurm, host, signal.SIGSTOP)
    assert pids
    try:
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _failure(logs) -> dict:
    (job,) = glob.glob(str(logs / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        return next(e for e in map(json.loads, f) if e["kind"] == "failure")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", [_kill_node, _freeze_node], ids=["killed", "frozen"])
def test_a_lost_node_is_left_out_and_the_job_finishes_smaller(slurm, tmp_path, fault):
    ckpt, out, logs = tmp_path / "ckpt", tmp_path / "final.pt", tmp_path / "logs"
    run = Lines(slurm.start_dslaunch(
        2, 1, "--max_restarts", "1", "--elastic_training", "--min_elastic_nodes", "1", "--resume_from", str(ckpt),
        "--log_dir", str(logs), SCRIPT, "--steps", "12", "--save_every", "3", "--sleep", "0.3", "--ckpt", str(ckpt),
        "--out", str(out)))
    try:
        run.wait_for(r"rank1 step=4", 1, timeout=120)  # the checkpoint of step 3 is published
        job = re.search(r"Granted job allocation (\d+)", run.text("err"))[1]
        (first,) = set(re.findall(r"^(\S+): \[rank0\] rank0 world=2", run.text("out"), re.M))
        (second,) = set(re.findall(r"^(\S+): \[rank1\] rank1 world=2", run.text("out"), re.M))
        faulted_at = time.time()
        with fault(slurm, second):
            assert run.finish(150) == 0, run.text("err")[-3000:]
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    err, stdout = run.text("err"), run.text("out")
    assert re.search(rf"dslaunch: restart 1 of 1 in 1 s after .*; without lost host\(s\) {second}$", err, re.M), err
    assert f"dslaunch: hosts now {first} (world size 1; left: {second}, joined: -)" in err, err
    resumed = [int(s) for s in re.findall(r"rank0 world=1 resumed_at=(\d+)", stdout)]
    assert len(resumed) == 1 and resumed[0] >= 3, stdout
    after = stdout.split("world=1 resumed_at")[-1]
    assert "rank1 " not in after and f"{second}: " not in after  # nothing ran on the lost node since
    assert re.search(r"\[rank0\] rank0 step=12$", stdout, re.M), stdout
    assert out.exists()
    failure = _failure(logs)
    if fault is _freeze_node:  # srun and its step stay up: only the node's silence tells
        assert (failure["cause"], failure["host"]) == ("host_lost", second), failure
        assert "no news from its agent for " in failure["message"], failure
        assert failure["detected_t"] - faulted_at < HOST_SILENT_S + 3, failure
    assert failure["detected_t"] - faulted_at < 10, failure  # the target for host loss
    # The allocation itself ended well, and nothing of the job is left on any node.
    assert slurm.job_state(job) == ("COMPLETED", "0:0"), slurm.job_info(job)
    assert slurm.wait_no_job_processes(25) == {}
