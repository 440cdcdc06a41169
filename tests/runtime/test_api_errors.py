"""A config mistake in a worker prints one line naming the key, not a traceback."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import torch
import dslaunch as deepspeed
deepspeed.initialize(model=torch.nn.Linear(2, 2), config={CONFIG!r}, dist_init_required=False)
"""


def _run(tmp_path, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2, "overlap_com": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.replace("{CONFIG!r}", repr(json.loads(json.dumps(config)))))
    env = {k: v for k, v in os.environ.items() if k != "DSLAUNCH_VERBOSE"}
    env.update(OMP_NUM_THREADS="1", **env_extra)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                          timeout=60)


@pytest.mark.timeout(90)
def test_config_error_is_one_line(tmp_path) -> None:
    proc = _run(tmp_path, {})
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        line for line in proc.stderr.strip().splitlines() if line.startswith("dslaunch: error:")]
    assert "'zero_optimization.overlap_com'" in proc.stderr and "did you mean 'overlap_comm'" in proc.stderr


@pytest.mark.timeout(90)
def test_verbose_keeps_the_traceback(tmp_path) -> None:
    proc = _run(tmp_path, {"DSLAUNCH_VERBOSE": "1"})
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr and "ConfigError" in proc.stderr
