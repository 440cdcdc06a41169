"""A job stopped for a hang stops every rank before any more steps or checkpoints: the stopped
rank is resumed for its stack dump only while its peers are frozen, and the job is then killed,
never resumed. The report's step is the one the hung rank stopped at."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

STALL = str(ROOT / "tests" / "launcher" / "bin" / "stall_pipe.py")


@pytest.mark.timeout(180)
def test_a_stopped_pipeline_stage_trains_and_saves_nothing_after_its_hang_is_declared(tmp_path, free_port):
    tag, logs, ckpt, stall_at = new_tag(), tmp_path / "logs", tmp_path / "ckpt", 3
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), "--log_dir", str(logs),
                      "--hang_timeout", "4", STALL], tag=tag, timeout=150, STALL_RANK="1", STALL_AT=str(stall_at),
                     SAVE_DIR=str(ckpt))
    assert r.returncode == 124, r.stderr[-3000:]
    assert f"rank 1 on localhost hung at step {stall_at} " in r.stderr and "it was stopped: SIGSTOP" in r.stderr
    trained = {int(rank): int(step) for rank, step in re.findall(r"^\[rank(\d)\] trained (\d+)$", r.stdout, re.M)}
    assert trained == {0: stall_at, 1: stall_at}, r.stdout[-2000:]  # the last step each rank finished
    tags = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step"))
    assert tags == [f"global_step{n}" for n in range(1, stall_at + 1)], tags
    (job,) = glob.glob(str(logs / "*"))
    with open(os.path.join(job, "error-rank1.json")) as f:
        record = json.load(f)
    assert record["cause"] == "hang" and record["step"] == stall_at and record["stacks"]["stopped"]
    with open(record["stacks"]["file"]) as f:
        assert "stall_pipe.py" in f.read()  # its stack, taken while its peer was frozen
    assert_no_job_process(tag, within=5.0)
