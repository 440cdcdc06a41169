"""DeepSpeed's CIFAR tutorial shape, launched as its run script does:
``deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from dslaunch.utils.ports import free_port
from tests.compat.conftest import SCRIPTS, run_job, tagged


@pytest.mark.timeout(120)
def test_cifar_tutorial_script_runs_under_the_deepspeed_command(compat_bin: Path, tmp_path: Path) -> None:
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "cifar_train.py"), "--deepspeed", "--deepspeed_config",
                   str(SCRIPTS / "cifar_ds_config.json"), "--steps", "4"], cwd=tmp_path)
    # `[rank0] ` prefixes (tagged) are dslaunch's launcher's: DeepSpeed's prints lines bare
    assert "[rank0] bf16=True" in out  # the tutorial's bf16 section (with fp16's keys) was accepted
    losses = tagged(out, "LOSSES")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert tagged(out, "STEPS") == 4
