"""The default ``--log_dir``: a per-user state directory, never the directory a job starts in;
``dslaunch status`` finds the job from anywhere."""

from __future__ import annotations

import os

import pytest

from dslaunch.launcher.plan import default_log_dir
from tests.launcher.helpers import FAKE, run_dslaunch


@pytest.mark.parametrize(("env", "want"), [
    ({"HOME": "/h"}, "/h/.local/state/dslaunch/logs"),
    ({"HOME": "/h", "XDG_STATE_HOME": "/x/state"}, "/x/state/dslaunch/logs"),
    ({"HOME": "/h", "XDG_STATE_HOME": "rel/state"}, "/h/.local/state/dslaunch/logs"),  # XDG: relative is ignored
    ({"HOME": "/h", "XDG_STATE_HOME": ""}, "/h/.local/state/dslaunch/logs"),
    ({"HOME": "/h", "XDG_STATE_HOME": "/x", "DSLAUNCH_LOG_DIR": "/runs/logs"}, "/runs/logs"),
    ({"HOME": "/h", "DSLAUNCH_LOG_DIR": ""}, "/h/.local/state/dslaunch/logs"),
])
def test_default_log_dir_follows_the_environment(env, want) -> None:
    assert default_log_dir(env) == want


def test_a_relative_env_log_dir_is_made_absolute(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_log_dir({"DSLAUNCH_LOG_DIR": "logs"}) == f"{tmp_path}/logs"


@pytest.mark.timeout(120)
def test_a_local_job_leaves_its_folder_clean_and_status_finds_it_from_elsewhere(tmp_path) -> None:
    home, work, other = tmp_path / "home", tmp_path / "work", tmp_path / "other"
    for d in (home, work, other):
        d.mkdir()
    env = {"HOME": str(home), "XDG_STATE_HOME": ""}  # the ~/.local/state fallback
    r = run_dslaunch(["--num_gpus", "1", FAKE, "print=hello"], cwd=str(work), timeout=60, **env)
    assert r.returncode == 0, r.stderr
    assert os.listdir(work) == []
    logs = home / ".local" / "state" / "dslaunch" / "logs"
    (job,) = os.listdir(logs)
    assert (logs / job / "events.jsonl").is_file()
    assert os.stat(logs / job).st_mode & 0o777 == 0o700
    s = run_dslaunch(["status"], cwd=str(other), **env)
    assert s.returncode == 0 and "state: finished" in s.stdout, (s.stdout, s.stderr)
    assert os.listdir(other) == []
    # the env var moves it; the flag beats both
    r = run_dslaunch(["--num_gpus", "1", FAKE], cwd=str(work), timeout=60, **env, DSLAUNCH_LOG_DIR=str(tmp_path / "env"))
    assert r.returncode == 0 and len(os.listdir(tmp_path / "env")) == 1, r.stderr
    r = run_dslaunch(["--num_gpus", "1", "--log_dir", str(tmp_path / "flag"), FAKE], cwd=str(work), timeout=60,
                     **env, DSLAUNCH_LOG_DIR=str(tmp_path / "env"))
    assert r.returncode == 0 and len(os.listdir(tmp_path / "flag")) == 1 and len(os.listdir(tmp_path / "env")) == 1
    assert os.listdir(work) == []
