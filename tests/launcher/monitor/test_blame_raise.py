"""The rank that raised first is blamed, not the first to exit: real pipeline and ZeRO jobs on
gloo through the ``dslaunch`` command, where the rank that raised is often still tearing down
(or stopped by the launcher) when the peers it left waiting have already exited.

Each case checks the three places a user reads: the job's last line, the error file and
``dslaunch status``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest

from tests.launcher.helpers import DSLAUNCH, ROOT, assert_no_job_process, new_tag, run_dslaunch

RAISE = str(ROOT / "tests" / "launcher" / "bin" / "raise_train.py")


def run_and_check_blame(tmp_path, port: int, stages: int, fail: int, world: int, **env: str) -> None:
    """Launch ``raise_train.py`` with rank ``fail`` raising; assert every report names it."""
    tag, logs = new_tag(), tmp_path / "logs"
    r = run_dslaunch(["--num_gpus", str(world), "--master_port", str(port), "--log_dir", str(logs), RAISE], tag=tag,
                     timeout=150, STAGES=str(stages), FAIL_RANK=str(fail), **env)
    said = f"rank {fail} on localhost raised ValueError: rank {fail} broke at forward"
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and last.startswith(f"dslaunch: error: {said}"), r.stderr[-3000:]
    (job,) = glob.glob(str(logs / "*"))
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(job, "error-rank*.json")))
    assert files == [f"error-rank{fail}.json"], files
    with open(os.path.join(job, files[0])) as f:
        record = json.load(f)
    assert record["root_cause"] is True and record["rank"] == fail and record["cause"] == "exception"
    assert record["exception"].startswith(f"ValueError: rank {fail} broke") and record["raised_at"] > 0
    assert f"ValueError: rank {fail} broke" in record["traceback"]
    status = subprocess.run([*DSLAUNCH, "status", job], capture_output=True, text=True, timeout=30)
    cause = [line for line in status.stdout.splitlines() if line.startswith("root cause: ")]
    assert cause and cause[0].startswith(f"root cause: {said}"), status.stdout
    assert_no_job_process(tag, within=5.0)


@pytest.mark.timeout(180)
# The first and the last stage at 2 stages, a middle one at 4 (4-stages-first and -last ran as
# the 2-stage cases, ~11 s a job).
@pytest.mark.parametrize(("stages", "fail"), [(2, 0), (2, 1), (4, 2)],
                         ids=["2-stages-first", "2-stages-last", "4-stages-middle"])
def test_a_pipeline_stage_that_raises_is_blamed(tmp_path, free_port, stages, fail):
    run_and_check_blame(tmp_path, free_port, stages, fail, world=stages)


@pytest.mark.timeout(180)
def test_a_zero_rank_that_raises_is_blamed_not_the_peer_whose_all_reduce_failed(tmp_path, free_port):
    run_and_check_blame(tmp_path, free_port, 0, 1, world=2, ZERO="2")
