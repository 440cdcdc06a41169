"""The ``deepspeed`` distribution of compat/deepspeed, as the libraries that look for DeepSpeed see
it: metadata, version checks, module identity, the command."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

_PROBE = r"""
import importlib.metadata, importlib.util, sys
import deepspeed, dslaunch
assert importlib.util.find_spec("deepspeed") is not None
assert importlib.metadata.version("deepspeed") == deepspeed.__version__, deepspeed.__version__
assert deepspeed.__version__.startswith("0.19.8+dslaunch."), deepspeed.__version__
from accelerate.utils import compare_versions, is_deepspeed_available
from transformers.integrations.deepspeed import is_deepspeed_available as hf_available
assert is_deepspeed_available() and hf_available()
assert compare_versions("deepspeed", ">=", "0.18.2")  # accelerate's newest minimum
import deepspeed.comm, deepspeed.runtime.engine, dslaunch.runtime.engine
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import logger, groups, set_z3_leaf_modules
from deepspeed.launcher.runner import DEEPSPEED_ENVIRONMENT_NAME
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
assert deepspeed.comm is dslaunch.comm and deepspeed.runtime.engine is dslaunch.runtime.engine
assert deepspeed.DeepSpeedEngine is dslaunch.runtime.engine.DeepSpeedEngine
assert deepspeed.initialize is dslaunch.initialize
assert "WarmupLR" in deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES  # attribute, no import
assert dslaunch.runtime.engine.__spec__.name == "dslaunch.runtime.engine"  # its own spec kept
assert DEEPSPEED_ENVIRONMENT_NAME == ".deepspeed_env"
with deepspeed.zero.GatheredParameters([], modifier_rank=0), deepspeed.zero.Init(enabled=False):
    pass  # no-ops below stage 3, as transformers and TRL use them
from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
keep = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}})
assert not keep.is_zero3() and not is_deepspeed_zero3_enabled()  # models then build as usual
from transformers import GPT2Config, GPT2LMHeadModel
GPT2LMHeadModel(GPT2Config(vocab_size=8, n_positions=4, n_embd=8, n_layer=1, n_head=1))
assert get_accelerator().device_name() == "cpu" and get_accelerator().communication_backend_name() == "gloo"
try:
    import deepspeed.no_such_module
except ModuleNotFoundError as err:
    assert err.name == "deepspeed.no_such_module", err.name
else:
    raise AssertionError("a module dslaunch lacks imported")
print("ok")
"""


@pytest.mark.timeout(60)
def test_deepspeed_distribution_is_dslaunch(compat_bin: Path) -> None:
    proc = subprocess.run([str(compat_bin / "python"), "-c", _PROBE], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-3000:]


@pytest.mark.timeout(30)
def test_deepspeed_command_is_dslaunchs_launcher(compat_bin: Path, tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    proc = subprocess.run([str(compat_bin / "deepspeed"), "--dry-run", "--num_gpus", "2", "train.py",
                           "--deepspeed_config", "ds.json"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=25)
    assert proc.returncode == 0, proc.stderr
    # dslaunch's plan: every worker's command with DSLAUNCH_* variables (DeepSpeed's runner has none)
    workers = [line for line in proc.stdout.splitlines() if "DSLAUNCH_RESTART_COUNT=0" in line]
    assert len(workers) == 2 and all("train.py --local_rank=" in w for w in workers), proc.stdout
