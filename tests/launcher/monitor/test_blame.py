"""Who a hang report blames, in real 2-rank engine jobs on gloo through ``dslaunch``.

Rank 1 stalls in the script's own code after step 3 (sleeping, spinning, blocked on a read, or
SIGSTOPped) while rank 0 goes on into step 4 and waits for it in one of the engine's collectives
(the gradient reducer's ``work.wait()``, stage 3's parameter gather, a publish): at every ZeRO
stage and with offload, rank 1 is named, and rank 0 is reported as waiting for it.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

STALL = str(ROOT / "tests" / "launcher" / "bin" / "stall_train.py")
STALL_PIPE = str(ROOT / "tests" / "launcher" / "bin" / "stall_pipe.py")
# Where rank 0 waits depends on the engine (ZeRO stage, offload), how rank 1 looks on the stall:
# every engine meets a stall and every stall an engine (not the whole 24-job grid, ~10 s a job;
# zero0-read and zero1-spin ran the same as zero2-read and zero2-optimizer-spin).
CASES = [("0", "", "sleep"), ("1", "", "stop"), ("2", "", "read"), ("3", "", "sleep"), ("2", "optimizer", "spin"),
         ("3", "param", "stop")]


def _stacks_event(tmp_path) -> dict:
    (job,) = glob.glob(str(tmp_path / "logs" / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        (event,) = [e for e in map(json.loads, f) if e["kind"] == "stacks"]
    return event


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("zero", "offload", "how"), CASES,
                         ids=[f"zero{z}{'-' + o if o else ''}-{h}" for z, o, h in CASES])
def test_the_rank_stalled_in_its_own_code_is_blamed_not_the_rank_waiting_for_it(tmp_path, free_port, zero,
                                                                                offload, how):
    tag = new_tag()
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), "--hang_timeout", "4",
                      "--log_dir", str(tmp_path / "logs"), STALL], tag=tag, timeout=120, ZERO=zero,
                     OFFLOAD=offload, STALL_RANK="1", STALL_AT="3", STALL_HOW=how)
    assert r.returncode == 124, r.stderr
    # (a stopped rank's last step may not have gone out: beats are sent at most twice a second)
    assert re.search(r"rank 1 on localhost hung( at step [0-3])? \(", r.stderr), r.stderr
    assert "(no progress for 4 s: --hang_timeout)" in r.stderr, r.stderr
    assert "rank 0 waited for it in " in r.stderr, r.stderr
    event = _stacks_event(tmp_path)
    assert event["behind"] == [1], event
    waiter, stalled = event["ranks"]["0"], event["ranks"]["1"]
    assert waiter["waiting"] and waiter["waiting_in"] and waiter["waiting_s"] > 0, event
    assert not stalled["waiting"] and stalled["waiting_in"] is None, event
    assert stalled["stopped"] == (how == "stop"), event
    assert_no_job_process(tag)


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage", [0, 1])
def test_a_stopped_pipeline_stage_is_blamed_not_the_stage_waiting_for_it(tmp_path, free_port, stage):
    """Stage ``stage`` SIGSTOPs itself after step 2; the other stage waits for it in step 3's
    pipeline receive (activations or gradients), and the report says which (the engine publishes
    each instruction). With one replica the stage's rank is its id."""
    tag = new_tag()
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), "--hang_timeout", "4",
                      "--log_dir", str(tmp_path / "logs"), STALL_PIPE], tag=tag, timeout=120,
                     STALL_RANK=str(stage), STALL_AT="2")
    other = 1 - stage
    # 1F1B at 2 stages: stage 0 sends micro-batches 0 and 1, then waits for 0's gradients
    what = ("stage 1 waiting to receive activations of micro-batch 0 from stage 0" if stage == 0 else
            "stage 0 waiting to receive gradients of micro-batch 0 from stage 1")
    assert r.returncode == 124, r.stderr
    assert re.search(rf"rank {stage} on localhost hung( at step [0-2])? \(", r.stderr), r.stderr
    assert f"rank {other} waited for it in pipeline receive from rank {stage} ({what})" in r.stderr, r.stderr
    event = _stacks_event(tmp_path)
    assert event["behind"] == [stage], event
    waiter, stopped = event["ranks"][str(other)], event["ranks"][str(stage)]
    assert waiter["waiting"] and waiter["waiting_in"] == f"pipeline receive from rank {stage}", event
    assert waiter["activity"] == what, event
    assert stopped["activity"] is None, event  # it stopped between batches, in the script's code
    assert stopped["stopped"] and not stopped["waiting"], event
    assert_no_job_process(tag)
