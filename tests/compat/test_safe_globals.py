"""The pattern scripts use to read DeepSpeed's files with ``torch.load(weights_only=True)``: import
DeepSpeed's ``LossScaler``, ``ZeroStageEnum`` and ``fragment_address`` and allow them with
``torch.serialization.add_safe_globals``. Under dslaunch the imports work and the allowed classes
are the ones DeepSpeed's pickles name, so the file loads into dslaunch's classes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.conftest import SCRIPTS

_LOAD = r"""
import sys, torch
path = sys.argv[1]
try:
    torch.load(path, weights_only=True)
    raise SystemExit("loaded without the allow list: the file does not hold DeepSpeed's classes")
except Exception as exc:
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in str(exc) or "Unsupported global" in str(exc), exc
from deepspeed.runtime.fp16.loss_scaler import LossScaler, DynamicLossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address
import dslaunch.runtime.fp16.loss_scaler as dsl
torch.serialization.add_safe_globals([LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address])
sd = torch.load(path, weights_only=True)
assert sd["zero_stage"] is ZeroStageEnum.gradients, sd["zero_stage"]
assert type(sd["loss_scaler"]) is dsl.LossScaler and sd["loss_scaler"].loss_scale == 128.0
dyn = sd["dynamic"]
assert type(dyn) is dsl.DynamicLossScaler
assert (dyn.cur_scale, dyn.cur_iter, dyn.last_overflow_iter, dyn.delayed_shift, dyn.cur_hysteresis,
        dyn.consecutive_hysteresis, dyn.scale_window, dyn.dtype) == (2.0**16, 7, 5, 2, 1, True, 500, torch.half)
dyn.update_scale(True)  # hysteresis 1 left: the loaded scaler halves, by dslaunch's rules
assert dyn.cur_scale == 2.0**15 and dyn.last_overflow_iter == 7
assert sd["param_slice_mappings"] == [{"w": fragment_address(numel=3, start=4)}]
assert torch.equal(sd["single_partition_of_fp32_groups"][0], torch.arange(4.0))
print("LOADED")
"""


@pytest.mark.timeout(120)
def test_deepspeed_files_load_with_the_safe_globals_pattern(compat_bin: Path, tmp_path: Path) -> None:
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    subprocess.run([sys.executable, str(SCRIPTS / "deepspeed_pickles.py"), str(path)], check=True, timeout=60)
    proc = subprocess.run([str(compat_bin / "python"), "-c", _LOAD, str(path)], capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0 and "LOADED" in proc.stdout, proc.stdout + proc.stderr[-3000:]
