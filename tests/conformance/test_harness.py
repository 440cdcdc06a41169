"""The conformance harness (``scripts/conformance``) without a DeepSpeed checkout: its pytest shim
records every outcome of a real pytest run, and the report counts them per area and computes the
share of DeepSpeed's passes that dslaunch keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "scripts" / "conformance"
sys.path.insert(0, str(HERE))

import report  # noqa: E402

_TESTS = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3

def test_skips():
    pytest.skip("not here")

@pytest.fixture
def broken():
    yield
    raise RuntimeError("teardown broke")

def test_teardown_error(broken):
    pass
'''


def _run_shim(tmp_path: Path) -> Path:
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_sample.py").write_text(_TESTS)
    (tmp_path / "unit" / "test_broken.py").write_text("import no_such_module_here\n\ndef test_x():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_SIZE"}
    return _shim_pytest(tmp_path, ["--continue-on-collection-errors", "unit"], env)


@pytest.mark.timeout(90)
def test_shim_records_each_outcome_and_collection_error(tmp_path: Path) -> None:
    run = report.read_events(_run_shim(tmp_path))
    outcomes = {nodeid.split("::")[1]: r.outcome for nodeid, r in run.results.items()}
    assert outcomes == {"test_passes": "passed", "test_fails": "failed", "test_skips": "skipped",
                        "test_teardown_error": "failed"}
    assert run.results["unit/test_sample.py::test_skips"].reason.endswith("not here")
    assert "teardown broke" in run.results["unit/test_sample.py::test_teardown_error"].reason
    assert "no_such_module_here" in run.collect_errors["unit/test_broken.py"]


@pytest.mark.timeout(90)
def test_shim_sets_the_cpu_accelerator_and_its_device_count(tmp_path: Path) -> None:
    (tmp_path / "test_env.py").write_text(
        "import os\n\ndef test_env():\n    assert os.environ['DS_ACCELERATOR'] == 'cpu'\n"
        "    assert os.environ['LOCAL_SIZE'] == '4'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "LOCAL_SIZE")}
    events = _shim_pytest(tmp_path, ["test_env.py"], env)
    assert [r.outcome for r in report.read_events(events).results.values()] == ["passed"]


@pytest.mark.timeout(90)
def test_shim_leaves_out_distributed_tests_when_asked(tmp_path: Path) -> None:
    (tmp_path / "test_dist.py").write_text(
        "class TestRanks:\n    is_dist_test = True\n\n    def test_a(self):\n        pass\n\n"
        "def test_plain():\n    pass\n")
    events = _shim_pytest(tmp_path, ["test_dist.py"], dict(os.environ, CONFORMANCE_NO_DISTRIBUTED="1"))
    assert list(report.read_events(events, unfinished_reason="x").results) == ["test_dist.py::test_plain"]


@pytest.mark.timeout(90)
def test_tests_deselected_by_mark_are_not_counted(tmp_path: Path) -> None:
    # DeepSpeed's pytest.ini deselects ``-m "not sequential"``: such a test never runs on either
    # side and must not count as an unfinished (failed) one.
    (tmp_path / "test_marks.py").write_text(
        "import pytest\n\n@pytest.mark.sequential\ndef test_seq():\n    pass\n\ndef test_plain():\n    pass\n")
    events = _shim_pytest(tmp_path, ["-m", "not sequential", "-p", "no:warnings", "test_marks.py"], dict(os.environ))
    assert list(report.read_events(events, unfinished_reason="x").results) == ["test_marks.py::test_plain"]


def test_a_run_of_some_files_replaces_only_theirs() -> None:
    old = report.SideRun({"a.py::t": report.Result("failed"), "a.py::d": report.Result("passed"),
                          "b.py::t": report.Result("passed")}, {"c.py": "E  ImportError"})
    new = report.SideRun({"a.py::t": report.Result("passed")}, {})
    merged = report.replace_files(old, new, ["a.py", "c.py"])
    assert merged.results == {"a.py::t": report.Result("passed"), "b.py::t": report.Result("passed")}
    assert merged.collect_errors == {}
    # a quick run (distributed tests left out) keeps the file's other recorded outcomes
    partial = report.replace_files(old, new, ["a.py"], complete=False)
    assert partial.results["a.py::d"] == report.Result("passed") and partial.results["a.py::t"].outcome == "passed"


def test_saved_outcomes_load_back(tmp_path: Path) -> None:
    run = report.SideRun({"a.py::t": report.Result("failed", "E  boom")}, {"b.py": "E  ImportError"})
    report.save(run, tmp_path / "side.json")
    assert report.load(tmp_path / "side.json") == run


def test_a_fresh_checkout_starts_from_the_recorded_outcomes(tmp_path: Path) -> None:
    recorded = {"tests": {"dslaunch": {"a.py::t": {"outcome": "passed", "reason": ""}}},
                "collect_errors": {"dslaunch": {"b.py": "E  ImportError"}}}
    (tmp_path / "conformance.json").write_text(json.dumps(recorded))
    run = report.load_recorded(tmp_path / "conformance.json", "dslaunch")
    assert run == report.SideRun({"a.py::t": report.Result("passed")}, {"b.py": "E  ImportError"})
    assert report.load_recorded(tmp_path / "conformance.json", "deepspeed") == report.SideRun()
    assert report.load_recorded(tmp_path / "absent.json", "dslaunch") == report.SideRun()


def _events(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_killed_run_fails_its_unfinished_tests(tmp_path: Path) -> None:
    events = _events(tmp_path / "e.jsonl", [
        {"event": "collected", "nodeid": "a.py::t1"}, {"event": "collected", "nodeid": "a.py::t2"},
        {"event": "file", "path": "a.py"}, {"event": "report", "nodeid": "a.py::t1", "outcome": "passed"}])
    run = report.read_events(events, unfinished_reason="timed out after 5 s")
    assert run.results["a.py::t1"].outcome == "passed"
    assert run.results["a.py::t2"] == report.Result("failed", "timed out after 5 s")
    assert "a.py::t2" not in report.read_events(events).results


def test_table_counts_per_area_and_the_kept_share(tmp_path: Path) -> None:
    ds = report.read_events(_events(tmp_path / "ds.jsonl", [
        {"event": "report", "nodeid": "a.py::t1", "outcome": "passed"},
        {"event": "report", "nodeid": "a.py::t2", "outcome": "passed"},
        {"event": "report", "nodeid": "a.py::t3", "outcome": "failed"},
        {"event": "report", "nodeid": "b.py::t1", "outcome": "passed"},
        {"event": "report", "nodeid": "b.py::t2", "outcome": "skipped"}]))
    dl = report.read_events(_events(tmp_path / "dl.jsonl", [
        {"event": "report", "nodeid": "a.py::t1", "outcome": "passed"},
        {"event": "report", "nodeid": "a.py::t2", "outcome": "failed", "reason": "E  boom"},
        {"event": "report", "nodeid": "a.py::t3", "outcome": "passed"},
        {"event": "collect_error", "nodeid": "b.py", "reason": "E  ImportError: x"}]))
    rows = report.area_rows({"A": ["a.py"], "B": ["b.py"]}, ds, dl)
    assert rows[0] == report.AreaRow("A", {"passed": 2, "failed": 1, "skipped": 0},
                                     {"passed": 2, "failed": 1, "skipped": 0}, kept=1)
    # b.py never loaded on dslaunch: each of DeepSpeed's tests there is a dslaunch failure
    assert rows[1].dslaunch == {"passed": 0, "failed": 2, "skipped": 0} and rows[1].kept == 0
    assert report.share_kept(rows) == (1, 3, pytest.approx(100 / 3))
    text = report.table(rows)
    assert "dslaunch passes 1 of the 3 tests DeepSpeed passes: 33.3%" in text
    lost = report.regressions(ds, dl)
    assert set(lost) == {"a.py::t2", "b.py::t1"}
    assert lost["b.py::t1"].reason == "not loaded: E  ImportError: x"


def test_expected_failures_are_read_from_the_table(tmp_path: Path) -> None:
    md = tmp_path / "EXPECTED.md"
    md.write_text("| test | kind | reason |\n|---|---|---|\n| `a.py::t2` | internals | x |\n"
                  "| `b.py::t[1-2]` | deliberate difference | y |\nnot a row `c.py::t`\n")
    assert report.expected_failures(md) == {"a.py::t2", "b.py::t[1-2]"}
    assert report.expected_failures(tmp_path / "missing.md") == set()


def _shim_pytest(where: Path, args: list[str], env: dict[str, str]) -> Path:
    """Run pytest with ``args`` in ``where``, the shim loaded; the events file it wrote."""
    events = where / "events.jsonl"
    env = dict(env, PYTHONPATH=str(HERE / "shim"), CONFORMANCE_EVENTS=str(events))
    subprocess.run([sys.executable, "-m", "pytest", "-p", "conformance_shim", "-p", "no:cacheprovider", "-q", *args],
                   cwd=where, env=env, capture_output=True, timeout=60, check=False)
    return events


def test_long_files_get_their_own_cap_and_are_files_of_the_suite() -> None:
    """A factor for a file the areas do not list would never apply (a renamed file loses its cap)."""
    import areas
    import run

    assert set(run.LONG_FILES) <= set(areas.all_files())
    long_file = next(iter(run.LONG_FILES))
    assert run._file_limit(long_file, 420) == 420 * run.LONG_FILES[long_file] > 420
    assert run._file_limit("unit/runtime/test_ds_config_dict.py", 420) == 420
    # before any file starts: collection's time, no file's (under load it alone passed a short cap)
    assert run._file_limit(None, 3) == run._file_limit(None, 420) == run.STARTUP_LIMIT_S


@pytest.mark.timeout(120)
def test_each_file_cut_by_its_cap_keeps_its_own_events_file(tmp_path: Path) -> None:
    """Two files that hang, each cut at the file cap: the run goes on after each, both files'
    unfinished tests count as failed, and each pytest process's events stay on disk (a second cut
    once overwrote the first one's)."""
    import argparse

    import run as conformance_run

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "unit").mkdir()
    files = []
    for name in ("a", "b", "c"):
        body = "import time\n\ndef test_hang():\n    time.sleep(60)\n" if name != "c" else "def test_ok():\n    pass\n"
        (tmp_path / "unit" / f"test_{name}.py").write_text(body)
        files.append(f"unit/test_{name}.py")
    # a cap the passing file's pytest starts and exits within, even on a loaded machine (3 s was cut once)
    args = argparse.Namespace(local_size=2, test_timeout=60, no_distributed=False, file_timeout=15, keyword=None)
    events = tmp_path / "side.jsonl"
    venv = Path(sys.executable).parent.parent
    result = conformance_run.run_side("dslaunch", venv, tmp_path, files, events, args)
    outcomes = {n: r.outcome for n, r in result.results.items()}
    assert outcomes == {"unit/test_a.py::test_hang": "failed", "unit/test_b.py::test_hang": "failed",
                        "unit/test_c.py::test_ok": "passed"}
    parts = sorted(p.name for p in tmp_path.glob("side.part*.jsonl"))
    assert parts == ["side.part1.jsonl", "side.part2.jsonl"]
    assert "test_a.py" in (tmp_path / parts[0]).read_text() and "test_b.py" in (tmp_path / parts[1]).read_text()


@pytest.mark.timeout(120)
def test_a_keyword_run_records_only_its_tests_and_keeps_the_files_others(tmp_path: Path) -> None:
    """``--keyword``: pytest's ``-k`` on the side's run; the recorded outcomes of the file's other
    tests stay (``replace_files`` with ``complete=False``)."""
    import argparse

    import run as conformance_run

    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "unit").mkdir()
    (tmp_path / "unit" / "test_k.py").write_text("def test_cache():\n    pass\n\ndef test_other():\n    assert False\n")
    args = argparse.Namespace(local_size=2, test_timeout=60, no_distributed=False, file_timeout=60, keyword="cache")
    fresh = conformance_run.run_side("dslaunch", Path(sys.executable).parent.parent, tmp_path, ["unit/test_k.py"],
                                     tmp_path / "side.jsonl", args)
    assert {n: r.outcome for n, r in fresh.results.items()} == {"unit/test_k.py::test_cache": "passed"}
    recorded = report.SideRun({"unit/test_k.py::test_cache": report.Result("failed"),
                               "unit/test_k.py::test_other": report.Result("passed")})
    merged = report.replace_files(recorded, fresh, ["unit/test_k.py"], complete=False)
    assert {n: r.outcome for n, r in merged.results.items()} == {"unit/test_k.py::test_cache": "passed",
                                                                  "unit/test_k.py::test_other": "passed"}
