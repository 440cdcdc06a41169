"""DeepSpeed's CIFAR tutorial shape, launched as its run script does:
``deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json``."""

from __future__ import annotations

import math
import os
import subprocess
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


@pytest.mark.timeout(120)
def test_cifar_moe_param_groups_of_a_dense_model_train(compat_bin: Path, tmp_path: Path) -> None:
    """The example's ``--moe-param-group`` path: ``split_params_into_different_moe_groups_for_optimizer``
    hands back the dense groups (with their ``name`` key) and the engine trains on them."""
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "cifar_train.py"), "--deepspeed", "--deepspeed_config",
                   str(SCRIPTS / "cifar_ds_config.json"), "--steps", "3", "--moe-param-group"], cwd=tmp_path)
    losses = tagged(out, "LOSSES")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


@pytest.mark.timeout(120)
def test_cifar_moe_run_is_refused_in_one_line(compat_bin: Path, tmp_path: Path) -> None:
    """``--moe`` builds ``deepspeed.moe.layer.MoE``: the job stops, naming the feature and what to do."""
    proc = subprocess.run([str(compat_bin / "deepspeed"), "--num_gpus", "1", "--master_port", str(free_port()),
                           str(SCRIPTS / "cifar_train.py"), "--deepspeed", "--deepspeed_config",
                           str(SCRIPTS / "cifar_ds_config.json"), "--moe"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    summary = [line for line in proc.stderr.splitlines() if line.startswith("dslaunch: error:")]
    assert summary and ("dslaunch.moe.layer.MoE: mixture of experts (expert parallelism) is not in dslaunch; "
                        "train a dense model" in summary[0]), proc.stderr[-3000:]
