"""A script started by ``srun`` directly (one task per rank, no launcher) gets its rank
environment from SLURM's variables in ``init_distributed``/``initialize``."""

from __future__ import annotations

import re
import sys

import pytest

from tests.launcher.runners.ssh.helpers import ROOT

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TRAIN = [str(ROOT / "scripts" / "examples" / "train.py"), "--deepspeed", "--deepspeed_config",
         str(ROOT / "scripts" / "examples" / "ds_config.json"), "--steps", "10"]


@pytest.mark.timeout(150)
def test_srun_started_ranks_train_zero2_across_two_nodes(slurm):
    # srun inside salloc: 2 nodes x 2 tasks, each task one rank; dslaunch is not involved.
    run = slurm.run("salloc", "--quiet", "--nodes=2", "--ntasks-per-node=2", "srun", "--kill-on-bad-exit=1",
                    "--label", sys.executable, "-u", *TRAIN, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:] + run.stdout[-2000:]
    assert re.search(r"^0: world_size=4 zero_stage=2", run.stdout, re.M), run.stdout
    assert re.search(r"^0: step +10 +loss [0-9.]+", run.stdout, re.M)
    assert re.search(r"^0: done: 10 steps", run.stdout, re.M)
