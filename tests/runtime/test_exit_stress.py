"""The short version of scripts/bench/exit_stress.py: finished jobs exit 0 and raising jobs exit 1
while a CPU hog loads the machine (issue: finished jobs exited 134 from a gloo abort in teardown)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

STRESS = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "exit_stress.py"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_no_job_exits_with_a_wrong_code_under_load(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(STRESS), "--runs", "2", "--raising", "1",
                           "--systems", "dslaunch", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=380)
    records = json.loads((tmp_path / "exit_stress.json").read_text())
    assert [(r["mode"], r["exit_code"]) for r in records if r["mode"] == "finish"] == [("finish", 0)] * 2, \
        proc.stderr[-3000:]
    assert [r["exit_code"] for r in records if r["mode"] == "raise"] == [1], proc.stderr[-3000:]
    assert not any(r["abort"] for r in records)
    assert proc.returncode == 0
