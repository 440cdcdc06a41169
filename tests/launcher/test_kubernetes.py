"""Kubernetes (launcher.kubernetes): the operator's variables make a pod a --no_ssh node; the manifests."""

from __future__ import annotations

import pytest

from dslaunch.errors import UsageError
from dslaunch.launcher.kubernetes import Pod, pod_from_env
from tests.launcher.helpers import FAKE, run_dslaunch

pytestmark = pytest.mark.timeout(60)

TRAINJOB = {"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "4",
            "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"}


def test_kubeflow_variables_and_an_indexed_jobs_completion_index():
    assert pod_from_env(TRAINJOB) == Pod(3, 2, "job-node-0-0.job", 29400, 4)
    indexed = {"PET_NNODES": "2", "JOB_COMPLETION_INDEX": "1", "MASTER_ADDR": "train-0.train", "PET_NPROC_PER_NODE": "auto"}
    assert pod_from_env(indexed) == Pod(2, 1, "train-0.train", None, None)
    assert pod_from_env({"JOB_COMPLETION_INDEX": "1"}) is None  # not a training job's pod


@pytest.mark.parametrize("change, message", [
    ({"PET_NNODES": "1:4"}, "PET_NNODES='1:4': an elastic range is not supported"),
    ({"PET_NODE_RANK": "3"}, "PET_NODE_RANK=3 is out of range for PET_NNODES=3 (valid: 0-2)"),
    ({"PET_NODE_RANK": None}, "neither PET_NODE_RANK nor JOB_COMPLETION_INDEX"),
    ({"PET_MASTER_ADDR": None}, "PET_MASTER_ADDR is not"),
    ({"PET_MASTER_PORT": "x"}, "PET_MASTER_PORT='x': expected an integer >= 1"),
])
def test_a_variable_the_operator_would_not_set_is_named(change, message):
    env = {k: v for k, v in {**TRAINJOB, **change}.items() if v is not None}
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        pod_from_env(env)


def test_in_a_pod_the_plan_is_this_pods_workers_with_their_global_ranks():
    r = run_dslaunch(["--dry-run", FAKE], PET_NNODES="3", PET_NODE_RANK="1", PET_NPROC_PER_NODE="2",
                     PET_MASTER_ADDR="10.9.8.7", PET_MASTER_PORT="29400")
    assert r.returncode == 0, r.stderr
    assert "Kubernetes pod 1 of 3 (PET_* variables): ranks 2-3 of 6 here, node 0 at 10.9.8.7" in r.stderr
    workers = [line for line in r.stdout.splitlines() if " RANK=" in line]
    assert [w.split(" RANK=")[1].split()[0] for w in workers] == ["2", "3"]
    assert all("MASTER_ADDR=10.9.8.7 MASTER_PORT=29400" in w and "WORLD_SIZE=6" in w for w in workers)
    bad = run_dslaunch(["--dry-run", FAKE], PET_NNODES="x")
    assert bad.returncode == 2 and "PET_NNODES='x'" in bad.stderr
    # --launcher (or a hostfile, --no_ssh) given by the user wins: the variables are not read
    mine = run_dslaunch(["--dry-run", "--launcher", "local", "--num_gpus", "1", FAKE], PET_NNODES="x")
    assert mine.returncode == 0 and "Kubernetes" not in mine.stderr and " RANK=0 " in mine.stdout
