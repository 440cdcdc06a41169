"""A hang in an MoE layer's all-to-all, in a real 2-rank engine job on gloo through ``dslaunch``:
the rank that skipped the dispatch is blamed, and the report names the layer and the experts its
peer waited on (``tests/launcher/bin/moe_skip.py``)."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from tests.launcher.helpers import ROOT, assert_no_job_process, new_tag, run_dslaunch

MOE_SKIP = str(ROOT / "tests" / "launcher" / "bin" / "moe_skip.py")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_rank_that_skips_an_moe_dispatch_is_blamed_with_the_layer_and_experts_waited_on(tmp_path, free_port):
    tag = new_tag()
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), "--hang_timeout", "4",
                      "--log_dir", str(tmp_path / "logs"), MOE_SKIP], tag=tag, timeout=120,
                     STALL_RANK="1", STALL_AT="2")
    assert r.returncode == 124, r.stderr
    assert re.search(r"rank 1 on localhost hung at step 2 \(no progress for 4 s: --hang_timeout\)", r.stderr), r.stderr
    # rank 1 went on to the gradient all-reduce; rank 0 waits for layer 1's experts 2-3, on rank 1
    assert "it was waiting in all_reduce of gradients" in r.stderr, r.stderr
    assert "rank 0 waited for it in moe all_to_all (dispatch) of layer 1, experts 2-3 on rank 1" in r.stderr, r.stderr
    (job,) = glob.glob(str(tmp_path / "logs" / "*"))
    with open(os.path.join(job, "events.jsonl")) as f:
        (event,) = [e for e in map(json.loads, f) if e["kind"] == "stacks"]
    assert event["behind"] == [1], event
    assert event["ranks"]["0"]["waiting_in"] == "moe all_to_all (dispatch) of layer 1, experts 0-3 on ranks 0-1", event
    assert_no_job_process(tag)
