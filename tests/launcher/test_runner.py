"""``python -m dslaunch.launcher.runner``: DeepSpeed's module entry point of its launcher
(``deepspeed.launcher.runner``) runs the launch command. Under the ``deepspeed`` name:
tests/compat/test_package.py."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.timeout(30)
def test_python_m_runner_is_the_launch_command(tmp_path):
    (tmp_path / "train.py").touch()
    run = [sys.executable, "-m", "dslaunch.launcher.runner", "--dry-run", "--num_gpus", "2"]
    ok = subprocess.run([*run, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert ok.returncode == 0, ok.stderr
    workers = [line for line in ok.stdout.splitlines() if "DSLAUNCH_RESTART_COUNT=0" in line]
    assert [w.endswith(f"train.py --local_rank={i}") for i, w in enumerate(workers)] == [True, True], ok.stdout
    missing = subprocess.run([*run, "nope.py"], cwd=tmp_path, capture_output=True, text=True, timeout=25)
    assert missing.returncode == 2 and missing.stderr.endswith(
        f"dslaunch: error: user script 'nope.py' not found (cwd: {tmp_path})\n"), missing.stderr
