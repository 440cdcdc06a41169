"""``DSLAUNCH_SHM_DIR`` naming no directory is the user's mistake, answered in one line: the job
fails with it instead of training over gloo under a misleading "no room" warning."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launcher.helpers import run_dslaunch

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["missing", "a file"])
def test_a_shm_dir_that_is_no_directory_fails_the_job_in_one_line(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "shm"
    if kind == "a file":
        target.write_text("")
    r = run_dslaunch(["--num_gpus", "2", "--log_dir", str(tmp_path / "logs"),
                      str(ROOT / "scripts" / "examples" / "train.py"), "--steps", "1",
                      "--deepspeed_config", str(ROOT / "scripts" / "examples" / "ds_config.json")],
                     timeout=110, DSLAUNCH_SHM_DIR=str(target))
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if line.startswith("dslaunch: error:")]
    assert said and f"DSLAUNCH_SHM_DIR={target}: not a directory" in said[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr + r.stdout
