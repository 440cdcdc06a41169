"""``scripts/bench/run_all.py``: a run never rewrites BENCHMARKS.md and names the tables it changed."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN_ALL = ROOT / "scripts" / "bench" / "run_all.py"
sys.path.insert(0, str(RUN_ALL.parent))
import run_all  # noqa: E402


@pytest.mark.timeout(30)
def test_an_unknown_name_is_one_line_listing_the_benchmarks_and_runs_nothing() -> None:
    before = (ROOT / "BENCHMARKS.md").read_bytes()
    r = subprocess.run([sys.executable, str(RUN_ALL), "no_such"], capture_output=True, text=True, timeout=25)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert "no benchmark named no_such" in line and "onebit" in line and "zero3" in line, line
    assert (ROOT / "BENCHMARKS.md").read_bytes() == before


@pytest.mark.timeout(10)
def test_changed_tables_are_the_new_and_rewritten_ones(tmp_path: Path) -> None:
    kept, rewritten = tmp_path / "kept.md", tmp_path / "rewritten.md"
    kept.write_text("a")
    rewritten.write_text("b")
    before = {p: p.stat().st_mtime_ns for p in (kept, rewritten)}
    time.sleep(0.01)
    rewritten.write_text("c")
    (tmp_path / "new.md").write_text("d")
    after = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.md")}
    assert run_all.changed_tables(before, after) == ["new.md", "rewritten.md"]
