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
def test_cifar_moe_run_trains_with_experts_over_two_ranks(compat_bin: Path, tmp_path: Path) -> None:
    """``--moe`` with the example's MoE flags (its ``run_ds_moe.sh``): 2 experts, one on each of 2
    ranks, top-1 with RSample noise, expert param groups. Each rank's expert learns from the tokens
    routed to it, so the two experts (copies of one Linear at the start) end up different."""
    out = run_job([str(compat_bin / "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                   str(SCRIPTS / "cifar_train.py"), "--deepspeed", "--deepspeed_config",
                   str(SCRIPTS / "cifar_ds_config.json"), "--steps", "4", "--moe", "--ep-world-size", "2",
                   "--num-experts", "2", "--top-k", "1", "--noisy-gate-policy", "RSample", "--moe-param-group"],
                  cwd=tmp_path)
    losses = tagged(out, "LOSSES")
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    experts = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if " EXPERTS " in line]
    assert len(experts) == 2 and experts[0] != experts[1], out[-3000:]
