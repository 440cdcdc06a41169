"""``dslaunch sbatch`` on the test SLURM: the batch script runs dslaunch in the allocation, and the
job's exit code is the failing rank's; sbatch reads each value as one argument."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.launcher.runners.ssh.helpers import FAKE, ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TRAIN = [str(ROOT / "scripts" / "examples" / "train.py"), "--deepspeed", "--deepspeed_config",
         str(ROOT / "scripts" / "examples" / "ds_config.json"), "--steps", "10"]


def _dslaunch_sbatch(slurm, *args: str, timeout: float = 150, **env: str):
    return slurm.run(sys.executable, "-m", "dslaunch.launcher.cli", "sbatch", *args, timeout=timeout, **env)


def _sbatch(slurm, tmp_path: Path, *args: str, timeout: float = 150):
    return _dslaunch_sbatch(slurm, "--nodes", "2", "--num_gpus", "2", "--gpus_per_node", "0", "--output",
                            str(tmp_path / "job-%j.out"), "--wait", *args, timeout=timeout)


def _job(run) -> str:
    m = re.fullmatch(r"Submitted batch job (\d+)\n", run.stdout)
    assert m, run.stdout + run.stderr
    return m[1]


@pytest.mark.timeout(180)
def test_sbatch_wait_trains_zero2_on_two_nodes_of_two_ranks(slurm, tmp_path):
    run = _sbatch(slurm, tmp_path, "--job_name", "dsl-train", *TRAIN)
    job = _job(run)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert run.returncode == 0, out[-3000:]
    assert slurm.job_state(job) == ("COMPLETED", "0:0")
    assert re.search(r"^dsl-node\d: \[rank0\] world_size=4 zero_stage=2", out, re.M), out[-3000:]
    assert slurm.job_info(job)["NumNodes"] == "2"
    assert re.search(r"\[rank0\] done: 10 steps", out)


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_slurm_job_with_its_code(slurm, tmp_path):
    run = _sbatch(slurm, tmp_path, "--no_local_rank", FAKE, "print=up", "r2:sleep=0.3", "r2:exit=9", "hang")
    job = _job(run)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert run.returncode == 9, out[-3000:]
    assert slurm.job_state(job) == ("FAILED", "9:0")
    assert re.search(r"error: rank 2 on dsl-node\d exited with code 9; stopped all other workers", out), out


@pytest.mark.timeout(60)
def test_sbatch_reads_each_value_as_one_argument(slurm, tmp_path):
    # Unquoted, sbatch would split the name at blanks, cut it at '#' and read --comment as an option.
    name = 'a "b" \\c #d --comment=INJECTED'
    run = _dslaunch_sbatch(slurm, "--nodes", "1", "--job_name", name, "--output", str(tmp_path / "my out %j"),
                           "--sbatch_args", "--hold", FAKE)
    job = _job(run)
    shown = slurm.run("squeue", "-h", "-j", job, "-O", "Name:200,Comment:50,STDOUT:300").stdout
    assert shown.split() == [*name.split(), "(null)", *str(tmp_path / "my out %j").split()], shown
