"""Inside a SLURM allocation: the allocation read from SLURM's variables, the plan built from it,
and what ``--dry-run`` shows (no SLURM needed: the variables are what SLURM would set)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from dslaunch.errors import HostfileError, UsageError
from dslaunch.launcher.cli.launch import parse_config
from dslaunch.launcher.gpus import Accelerators
from dslaunch.launcher.plan import build_job
from dslaunch.launcher.runners.slurm.allocation import from_env

pytestmark = pytest.mark.timeout(30)

CPU = lambda: Accelerators("cpu", 2, reason="no NVIDIA driver found")  # noqa: E731
ALLOC = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu-a[01-02],n7", "SLURM_NTASKS_PER_NODE": "2",
         "SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}


def _plan(args: list[str], env: dict[str, str]):
    cfg, _ns = parse_config([*args, "train.py"], env)
    return build_job(cfg, CPU)


def test_no_allocation_outside_slurm_and_counts_in_slurms_run_length_form():
    assert from_env({}) is None
    alloc = from_env({**ALLOC, "SLURM_GPUS_ON_NODE": "4"})
    assert alloc.hosts == ("gpu-a01", "gpu-a02", "n7")
    assert (alloc.slots, alloc.slots_from, alloc.cpus) == (4, "SLURM_GPUS_ON_NODE", (8, 8, 4))


@pytest.mark.parametrize("env, words", [
    ({"SLURM_JOB_ID": "1"}, "SLURM_JOB_ID='1' is set but SLURM_JOB_NODELIST is not"),
    ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[3-1]"}, "SLURM_JOB_NODELIST"),
    ({**ALLOC, "SLURM_NTASKS_PER_NODE": "two"}, "SLURM_NTASKS_PER_NODE='two': 'two' is not a count"),
])
def test_unreadable_variables_are_one_line_naming_the_variable(env, words):
    with pytest.raises((UsageError, HostfileError)) as info:
        from_env(env)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_inside_an_allocation_the_nodes_are_the_hosts_and_slurm_is_the_launcher():
    plan = _plan([], ALLOC)
    job = plan.job
    assert job.launcher == "slurm" and job.hostfile == "SLURM_JOB_NODELIST"
    assert [n.host for n in job.nodes] == ["gpu-a01", "gpu-a02", "n7"] and job.world_size == 6
    assert job.master_addr == "gpu-a01"
    assert [w.global_rank for w in job.nodes[2].workers] == [4, 5]
    assert "CUDA_VISIBLE_DEVICES" not in job.nodes[0].env  # the step's own, from SLURM
    assert plan.notes == ("2 workers per node (SLURM_NTASKS_PER_NODE=2)",)


def test_num_gpus_and_exclude_pick_slots_per_node_and_whole_nodes():
    job = _plan(["--num_gpus", "3", "--exclude", "gpu-a02"], ALLOC).job
    assert [(n.host, len(n.workers)) for n in job.nodes] == [("gpu-a01", 3), ("n7", 3)]
    assert job.launcher == "slurm"


def test_a_hostfile_or_no_ssh_is_not_slurm(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=1\nb slots=1\n")
    assert _plan(["-H", str(hostfile)], ALLOC).job.launcher == "ssh"
    assert _plan([], {}).job.launcher == "local"


@pytest.mark.parametrize("args, env, words", [
    (["--launcher", "slurm"], {}, "--launcher slurm runs inside a SLURM allocation, but SLURM_JOB_ID is not set"),
    (["--include", "gpu-a01:0"], ALLOC, "--include 'gpu-a01:0': under SLURM, include/exclude select whole nodes"),
    (["--include", "nope"], ALLOC, "--include: unknown host 'nope'"),
    (["--num_gpus", "5"], {**ALLOC, "SLURM_GPUS_ON_NODE": "4"}, "--num_gpus 5: the allocation has 4 GPUs per node"),
])
def test_mistakes_are_one_line(args, env, words):
    with pytest.raises((UsageError, HostfileError)) as info:
        _plan(args, env)
    assert words in str(info.value), str(info.value)


def test_dry_run_shows_one_srun_per_node():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--dry-run", "--exclude", "gpu-a02",
                          "--launcher_args", "--mem=0", "train.py"], capture_output=True, text=True,
                         env={**env, **ALLOC}, timeout=20)
    assert out.returncode == 0, out.stderr
    sruns = [shlex.split(line) for line in out.stdout.splitlines() if line.startswith("srun ")]
    assert [a[:9] for a in sruns] == [
        ["srun", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--overlap", "--quiet",
         f"--job-name=dslaunch-node{rank}", f"--cpus-per-task={cpus}", "--mem=0"]
        for rank, host, cpus in ((0, "gpu-a01", 8), (1, "n7", 4))]
    assert all(a[9:12] == [sys.executable, "-m", "dslaunch.launcher.agent.bootstrap"] for a in sruns)
    assert "# node 1: n7 (2 workers)" in out.stdout
