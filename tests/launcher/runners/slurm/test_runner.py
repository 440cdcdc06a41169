"""``--launcher slurm`` on the test SLURM: dslaunch inside an allocation (``salloc``), one node
agent per node through srun."""

from __future__ import annotations

import re

import pytest

from tests.launcher.runners.ssh.helpers import FAKE, ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TRAIN = [str(ROOT / "scripts" / "examples" / "train.py"), "--deepspeed", "--deepspeed_config",
         str(ROOT / "scripts" / "examples" / "ds_config.json"), "--steps", "10"]


@pytest.mark.timeout(150)
def test_two_nodes_train_zero2_through_srun(slurm):
    run = slurm.dslaunch(2, 2, *TRAIN)
    assert run.returncode == 0, run.stderr[-3000:]
    # Chosen by itself (no --launcher): SLURM_JOB_ID is set and no hostfile given.
    assert "2 workers per node (SLURM_NTASKS_PER_NODE=2)" in run.stderr
    assert re.search(r"^dsl-node1: \[rank0\] world_size=4 zero_stage=2", run.stdout, re.M), run.stdout
    losses = [float(v) for v in re.findall(r"\[rank0\] step +10 +loss ([0-9.]+)", run.stdout)]
    assert len(losses) == 1 and losses[0] > 0
    assert re.search(r"^dsl-node1: \[rank0\] done: 10 steps", run.stdout, re.M)
    assert slurm.wait_no_job_processes(5) == {}


@pytest.mark.timeout(90)
def test_a_failing_rank_fails_the_allocation_with_its_code(slurm):
    run = slurm.dslaunch(2, 2, "--no_local_rank", FAKE, "print=up", "r3:sleep=0.5", "r3:exit=7", "hang")
    assert run.returncode == 7, run.stderr[-3000:]
    assert "error: rank 3 on dsl-node2 exited with code 7" in run.stderr, run.stderr[-3000:]
    assert "srun: error" not in run.stderr  # the agent's status said it already
    assert len(re.findall(r"\[rank\d\] up", run.stdout)) == 4
    assert slurm.wait_no_job_processes(5) == {}  # the hanging ranks were stopped on both nodes


@pytest.mark.timeout(90)
def test_exclude_selects_nodes_and_ranks_get_the_contract(slurm):
    run = slurm.dslaunch(3, 1, "--exclude", "dsl-node2", "--num_gpus", "2", "--no_local_rank", FAKE, "env")
    assert run.returncode == 0, run.stderr[-3000:]
    hosts = sorted(set(re.findall(r"^(dsl-node\d): \[rank\d\]", run.stdout, re.M)))
    assert hosts == ["dsl-node1", "dsl-node3"]
    assert '"WORLD_SIZE": "4"' in run.stdout and '"MASTER_ADDR": "dsl-node1"' in run.stdout
