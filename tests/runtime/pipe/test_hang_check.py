"""The short version of scripts/pipeline_hang_check.py (200 runs at 2-4 stages, 0 hangs): one run
at each of 2, 3 and 4 stages, 1F1B, finishes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[3] / "scripts" / "pipeline_hang_check.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_pipeline_runs_at_2_to_4_stages_do_not_hang(tmp_path) -> None:
    proc = subprocess.run([sys.executable, str(CHECK), "--runs", "3", "--timeout", "90", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    runs = json.loads((tmp_path / "pipeline_hang_check.json").read_text())["runs"]
    assert [(r["stages"], r["outcome"]) for r in runs] == [(2, "ok"), (3, "ok"), (4, "ok")], proc.stderr[-3000:]
    assert proc.returncode == 0
