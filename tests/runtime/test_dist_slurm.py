"""The rank environment of a task ``srun`` started directly, from SLURM's variables."""

from __future__ import annotations

import pytest

from dslaunch.errors import HostfileError
from dslaunch.runtime.dist import slurm_env

pytestmark = pytest.mark.timeout(10)

STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[01-04]", "SLURM_STEP_NODELIST": "n[03-04]"}


def test_a_step_task_gets_rank_world_local_rank_and_the_steps_first_node_as_master():
    env = slurm_env(STEP)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "n03"}
    port = int(env["MASTER_PORT"])
    assert 10000 <= port < 30000
    assert slurm_env({**STEP, "SLURM_PROCID": "0"})["MASTER_PORT"] == str(port)  # every rank agrees
    assert slurm_env({**STEP, "SLURM_STEP_ID": "4"})["MASTER_PORT"] != str(port)  # the next step differs


def test_without_a_step_nodelist_the_jobs_first_node():
    step = {k: v for k, v in STEP.items() if k != "SLURM_STEP_NODELIST"}
    assert slurm_env(step)["MASTER_ADDR"] == "n01"


@pytest.mark.parametrize("env", [
    {},
    {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"},  # the batch script itself: not a rank
    {**STEP, "RANK": "0"},  # a launcher set the contract (dslaunch's own workers under srun)
])
def test_nothing_outside_a_step_or_under_a_launcher(env):
    assert slurm_env(env) == {}


def test_values_already_set_win_and_a_bad_nodelist_is_named():
    assert "MASTER_ADDR" not in slurm_env({**STEP, "MASTER_ADDR": "10.0.0.1"})
    with pytest.raises(HostfileError, match="SLURM_STEP_NODELIST"):
        slurm_env({**STEP, "SLURM_STEP_NODELIST": "n[4-1]"})
