"""Tokens/s and MFU from a real 2-rank engine job's beats, as ``dslaunch status`` tells them."""

from __future__ import annotations

import json
import re

import pytest

from tests.launcher.helpers import ROOT, run_dslaunch

pytestmark = pytest.mark.timeout(120)

LM = str(ROOT / "tests" / "launcher" / "bin" / "lm_train.py")
FLOPS_PER_STEP = 6 * (32 * 8 + 8 * 32 + 32) * 32  # 6N x the 32 tokens one rank sees a step (lm_train.py)
PEAK = 1e8


def test_status_shows_tokens_per_second_and_mfu_of_a_two_rank_job(tmp_path):
    r = run_dslaunch(["--num_gpus", "2", "--log_dir", str(tmp_path / "logs"), LM], timeout=90,
                     DSLAUNCH_PEAK_FLOPS=str(PEAK), DSLAUNCH_PEAK_CACHE=str(tmp_path / "peak.json"),
                     STEPS="6", SLEEP="0.1")
    assert r.returncode == 0, r.stderr
    (job,) = (tmp_path / "logs").iterdir()
    summary = [e for e in map(json.loads, (job / "events.jsonl").read_text().splitlines())
               if e["kind"] == "summary"][-1]
    # Every step sleeps 0.1 s: at most 2 ranks x 32 tokens per 0.1 s, and this rank's FLOPs in that time.
    assert 0 < summary["tokens_per_s"] <= 2 * 32 / 0.1
    assert 0 < summary["mfu"] <= FLOPS_PER_STEP / 0.1 / PEAK and summary["mfu_from"] == "6N*tokens"
    status = run_dslaunch(["status", str(job)])
    assert status.returncode == 0, status.stderr
    (progress,) = [line for line in status.stdout.splitlines() if line.startswith("progress: ")]
    want = (rf"progress: step 6 \| [\d.]+ samples/s \| {summary['tokens_per_s']:.0f} tokens/s \| "
            rf"MFU {100 * summary['mfu']:.1f}% \(6N\*tokens\) \| loss ")
    assert re.match(want, progress), progress
