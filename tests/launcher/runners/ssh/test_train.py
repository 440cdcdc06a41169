"""A ZeRO-2 training job over SSH (2 hosts x 2 workers) matches the same job on one host.

The one-host reference is the session's ``local_losses_world4`` (conftest.py), which the mpirun
and pod tests compare with too: one local run for the three. Three hosts at once are the other
SSH tests' (test_runner's six ranks, test_elastic's lost host)."""

from __future__ import annotations

import re

import pytest

from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TRAIN = [str(ROOT / "scripts" / "examples" / "train.py"), "--deepspeed", "--deepspeed_config",
         str(ROOT / "scripts" / "examples" / "ds_config.json"), "--steps", "20"]


def _losses(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"\[rank0\] step +(\d+) +loss ([0-9.]+)", text)]


@pytest.mark.timeout(150)
def test_zero2_training_over_ssh_matches_single_host(cluster, free_port, tmp_path, local_losses_world4):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=2\n" for h in cluster.hosts[:2]))
    run = Lines(cluster.dslaunch("--master_port", str(free_port), *TRAIN, hostfile=str(hostfile)))
    assert run.finish(120) == 0, run.text("err")[-3000:]
    remote = _losses(run.text("out"))
    assert [s for s, _ in remote] == [10, 20]
    assert remote[1][1] < remote[0][1]  # it learns
    assert [s for s, _ in local_losses_world4] == [10, 20]
    assert [v for _, v in remote] == pytest.approx([v for _, v in local_losses_world4], abs=1e-4)
    # 4 ranks from a hostfile of 2 hosts x 2 slots: both hosts ran ranks
    assert re.search(r"^dsl-node1: \[rank0\] world_size=4 zero_stage=2", run.text("out"), re.M)
    assert cluster.wait_no_job_processes(3) == {}
