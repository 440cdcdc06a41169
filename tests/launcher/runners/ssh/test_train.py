"""A ZeRO-2 training job over SSH (3 hosts x 2 workers) matches the same job on one host."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.launcher.runners.ssh.helpers import ROOT, Lines

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TRAIN = [str(ROOT / "scripts" / "examples" / "train.py"), "--deepspeed", "--deepspeed_config",
         str(ROOT / "scripts" / "examples" / "ds_config.json"), "--steps", "20"]


def _losses(text: str) -> list[tuple[int, float]]:
    return [(int(s), float(v)) for s, v in re.findall(r"\[rank0\] step +(\d+) +loss ([0-9.]+)", text)]


@pytest.mark.timeout(150)
def test_zero2_training_over_ssh_matches_single_host(cluster, free_port):
    run = Lines(cluster.dslaunch("--master_port", str(free_port), *TRAIN))
    assert run.finish(120) == 0, run.text("err")[-3000:]
    local = subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "--num_gpus", "6",
                            "--master_port", str(free_port), *TRAIN],
                           capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = _losses(run.text("out"))
    assert [s for s, _ in remote] == [10, 20]
    assert remote[1][1] < remote[0][1]  # it learns
    reference = _losses(local.stdout)
    assert [s for s, _ in reference] == [10, 20]
    assert [v for _, v in remote] == pytest.approx([v for _, v in reference], abs=1e-4)
    assert re.search(r"^dsl-node1: \[rank0\] world_size=6 zero_stage=2", run.text("out"), re.M)
    assert cluster.wait_no_job_processes(3) == {}
