"""Pre-emption on the test SLURM: SLURM's warning signal to a ``dslaunch sbatch --requeue
--resume_from DIR`` job makes every rank checkpoint the same step into DIR, dslaunch requeues the
job, and the requeued job resumes from that step."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.launcher.runners.ssh.helpers import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CKPT_TRAIN = str(ROOT / "tests" / "launcher" / "bin" / "ckpt_train.py")


# SLURM's states of a job that will not run again (a requeued job passes through PENDING instead).
_ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
          "DEADLINE")


def _wait_for(slurm, job: str, path: Path, pattern: str) -> re.Match:
    """Until ``pattern`` is in the job's output, however slowly a busy machine gets there (only
    pytest-timeout bounds it); fails at once, with the output, if the job ends without it."""
    while True:
        state = slurm.job_info(job).get("JobState")
        text = path.read_text() if path.exists() else ""  # read after the state: an ended job's output is whole
        if m := re.search(pattern, text, re.M):
            return m
        assert state not in _ENDED, f"job {job} ended {state} without {pattern!r} in {path}: {text[-3000:]}"
        time.sleep(0.5)


def _wait_for_state(slurm, job: str, states: tuple[str, ...]) -> str:
    """Until the job is in one of ``states`` (only pytest-timeout bounds it); returns it."""
    while (state := slurm.job_info(job).get("JobState")) not in states:
        time.sleep(0.5)
    return state


def _start_requeued_now(slurm, job: str) -> None:
    """Skip the ~2 min SLURM holds a requeued job (BeginTime), but only once its first run is gone
    from the nodes and a whole second has passed: slurmd refuses a batch launch whose credential was
    made in the same second as the requeue revoked the old one ("Job N already killed, do not launch
    batch job"), and the job then ends FAILED 1:0 without output (1 run in 3 here under load).
    PENDING (no longer COMPLETING) says every node has handled the requeue's kill, revocation included."""
    while left := slurm.wait_no_job_processes(5):
        print(f"waiting for the first run's processes to leave: {left}")
    _wait_for_state(slurm, job, ("PENDING",))
    time.sleep(2)  # the whole second after the revocation: a time, not a state, is what slurmd compares
    assert slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0


# Two runs of a 2-rank job (torch imports, 25 steps of 0.3 s) and SLURM's scheduling: ~1 min on an
# idle machine; every wait is on what it waits for, so this bound is the only one.
@pytest.mark.timeout(900)
def test_the_warning_signal_checkpoints_requeues_and_the_job_resumes(slurm, tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "job.out"
    run = slurm.run(sys.executable, "-m", "dslaunch.launcher.cli", "sbatch", "--nodes", "2", "--num_gpus", "1",
                    "--gpus_per_node", "0", "--requeue", "--output", str(out), "--sbatch_args", "--open-mode=append",
                    "--resume_from", str(ckpt), CKPT_TRAIN, "--steps", "25", "--save_every", "1000",
                    "--ckpt", str(ckpt), "--out", str(tmp_path / "w.pt"), "--sleep", "0.3")
    job = re.fullmatch(r"Submitted batch job (\d+)\n", run.stdout)[1]
    _wait_for(slurm, job, out, r"\[rank1\] rank1 step=3$")
    # What SLURM sends the batch shell before the time limit with --signal=B:USR1@120.
    assert slurm.run("scancel", "--batch", "--signal=USR1", job).returncode == 0
    saved = _wait_for(slurm, job, out, r"checkpoint requested \(pre-emption\): step (\d+) saved to")
    step = int(saved[1])
    _wait_for(slurm, job, out, rf"dslaunch: job {job} requeued \(restart 1\)")
    _start_requeued_now(slurm, job)
    _wait_for_state(slurm, job, _ENDED)
    info, text = slurm.job_info(job), out.read_text()
    assert (info["JobState"], info["Restarts"], info["ExitCode"]) == ("COMPLETED", "1", "0:0"), text[-3000:]
    assert 3 <= step < 25
    # Both ranks stopped at the same step; the second run started from it and finished.
    assert re.findall(r"\[rank0\] rank0 world=2 resumed_at=(\d+)", text) == ["0", str(step)], text[-3000:]
    assert f"rank1 step={step + 1}" not in text.split("requeued")[0]
    assert re.search(r"\[rank0\] rank0 step=25$", text, re.M)
    assert (tmp_path / "w.pt").exists()
