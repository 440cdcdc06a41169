"""``dslaunch sbatch`` on the test SLURM: the batch script runs dslaunch in the allocation, and the
job's exit code is the failing rank's; sbatch reads each value as one argument; on these nodes,
which have no GPUs, ``--num_gpus`` runs CPU workers unless ``--gpus_per_node`` asks for GPUs."""

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


NO_GPUS = ("dslaunch: partition 'debug' has no GPUs (no gpu GRES on its nodes): asking for 2 tasks per node "
           "and no GPUs, the ranks run on CPUs (--gpus_per_node N asks for GPUs)\n")


@pytest.mark.timeout(120)
def test_num_gpus_on_nodes_without_gpus_runs_cpu_workers(slurm, tmp_path):
    # --num_gpus alone would be --gpus-per-node, which SLURM refuses on nodes without gpu GRES.
    run = _dslaunch_sbatch(slurm, "--nodes", "2", "--num_gpus", "2", "--output", str(tmp_path / "job-%j.out"),
                           "--wait", "--no_local_rank", FAKE, "print=up{rank}")
    job = _job(run)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert run.returncode == 0 and run.stderr == NO_GPUS, run.stderr + out[-3000:]
    assert slurm.job_state(job) == ("COMPLETED", "0:0")
    assert sorted(re.findall(r"\bup(\d)$", out, re.M)) == ["0", "1", "2", "3"], out[-3000:]


@pytest.mark.timeout(60)
def test_dry_run_asks_the_partition_and_says_what_it_chose(slurm):
    run = _dslaunch_sbatch(slurm, "--dry-run", "--nodes", "2", "--num_gpus", "2", FAKE)
    assert run.returncode == 0 and run.stderr == NO_GPUS, run.stderr
    assert "#SBATCH --ntasks-per-node=2" in run.stdout and "gpus-per-node" not in run.stdout


@pytest.mark.timeout(60)
def test_gpus_per_node_wins_over_what_the_partition_offers(slurm):
    run = _dslaunch_sbatch(slurm, "--nodes", "2", "--num_gpus", "2", "--gpus_per_node", "1", FAKE)
    # Asked for anyway: SLURM itself refuses (nothing was decided for the user, so no note).
    assert run.returncode == 1 and run.stdout == "", run.stdout
    assert run.stderr.startswith("dslaunch: error: sbatch refused the job: ") and run.stderr.count("\n") == 1
    assert "Invalid generic resource (gres) specification" in run.stderr, run.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, env, named", [
    (["--partition", "debgu"], {}, "--partition 'debgu'"),
    (["--partition", "debug,nope"], {}, "--partition 'debug,nope'"),
    ([], {"SBATCH_PARTITION": "nope"}, "SBATCH_PARTITION 'nope'"),
])
def test_an_unknown_partition_is_one_line_naming_the_clusters(slurm, args, env, named):
    run = _dslaunch_sbatch(slurm, "--dry-run", "--nodes", "1", "--num_gpus", "2", *args, FAKE, **env)
    wrong = named.split("'")[1].split(",")[-1]
    hint = " (did you mean 'debug'?)" if wrong == "debgu" else ""
    assert run.returncode == 2 and run.stdout == "", run.stdout
    assert run.stderr == f"dslaunch: error: {named}: SLURM has no partition '{wrong}'{hint}; it has debug\n"


@pytest.mark.timeout(60)
def test_sbatch_reads_each_value_as_one_argument(slurm, tmp_path):
    # Unquoted, sbatch would split the name at blanks, cut it at '#' and read --comment as an option.
    name = 'a "b" \\c #d --comment=INJECTED'
    run = _dslaunch_sbatch(slurm, "--nodes", "1", "--job_name", name, "--output", str(tmp_path / "my out %j"),
                           "--sbatch_args", "--hold", FAKE)
    job = _job(run)
    shown = slurm.run("squeue", "-h", "-j", job, "-O", "Name:200,Comment:50,STDOUT:300").stdout
    assert shown.split() == [*name.split(), "(null)", *str(tmp_path / "my out %j").split()], shown
