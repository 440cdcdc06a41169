"""Faults in a real 2-rank gloo job on localhost, through the ``dslaunch`` command: each one is
detected, classified, explained (error file, stacks, events.jsonl) and ends the job with its code.

The job is ``tests/launcher/bin/train_loop.py``: a custom loop that reports with
``dslaunch.heartbeat`` and never calls ``initialize``.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.launcher.helpers import DSLAUNCH, ROOT, assert_no_job_process, new_tag, tagged_env

LOOP = str(ROOT / "tests" / "launcher" / "bin" / "train_loop.py")


def _start(tmp_path, free_port, *flags: str, tag: str, **env: str) -> subprocess.Popen:
    args = [*DSLAUNCH, "--num_gpus", "2", "--master_port", str(free_port), "--log_dir", str(tmp_path / "logs"),
            *flags, LOOP]
    return subprocess.Popen(args, env=tagged_env(tag, **env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _pids(proc: subprocess.Popen) -> dict[int, int]:
    """rank -> pid, from the workers' first lines."""
    pids: dict[int, int] = {}
    while len(pids) < 2:
        line = proc.stdout.readline()
        assert line, f"job ended early: {proc.stderr.read()}"
        if " pid " in f" {line}" and line.split("] ", 1)[-1].startswith("pid "):
            _, rank, pid = line.split("] ", 1)[-1].split()
            pids[int(rank)] = int(pid)
    return pids


def _job_dir(tmp_path) -> str:
    (job,) = glob.glob(str(tmp_path / "logs" / "*"))
    return job


def _events(job: str) -> list[dict]:
    with open(os.path.join(job, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def _one(events: list[dict], kind: str) -> dict:
    found = [e for e in events if e["kind"] == kind]
    assert len(found) == 1, events
    return found[0]


def _wait_steps(job_glob: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    """Until every rank is up (events.jsonl says ranks_up) and a few steps passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job in glob.glob(job_glob):
            if any(e["kind"] == "ranks_up" for e in _events(job)):
                time.sleep(1.0)  # some steps
                return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.1)
    raise AssertionError("ranks never came up")


@pytest.mark.timeout(120)
def test_sigkill_of_one_rank_names_it_and_writes_its_error_file(tmp_path, free_port):
    tag = new_tag()
    proc = _start(tmp_path, free_port, tag=tag)
    pids = _pids(proc)
    _wait_steps(str(tmp_path / "logs" / "*"), proc)
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 137, err
    assert "rank 1 on localhost was killed by SIGKILL (exit code 137) (last reported step " in err
    job = _job_dir(tmp_path)
    events = _events(job)
    failure = _one(events, "failure")
    assert (failure["rank"], failure["cause"], failure["signal"]) == (1, "signal", "SIGKILL")
    assert failure["step"] >= 1
    assert killed_at - 1 < failure["fault_t"] <= failure["detected_t"]
    with open(os.path.join(job, "error-rank1.json")) as f:
        record = json.load(f)
    assert record["root_cause"] and record["cause"] == "signal" and record["exit_code"] == 137
    assert _one(events, "end")["exit_code"] == 137
    assert_no_job_process(tag)


@pytest.mark.timeout(120)
def test_sigstop_of_one_rank_is_a_hang_naming_it_with_stacks(tmp_path, free_port):
    tag = new_tag()
    proc = _start(tmp_path, free_port, "--hang_timeout", "5", tag=tag)
    pids = _pids(proc)
    _wait_steps(str(tmp_path / "logs" / "*"), proc)
    stopped_at = time.monotonic()
    os.kill(pids[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        os.kill(pids[1], signal.SIGCONT) if proc.returncode is None else None
    took = time.monotonic() - stopped_at
    assert proc.returncode == 124, err
    assert 4.5 < took < 30, took  # the timeout, and not gloo's (60 s here)
    assert "rank 1 on localhost hung at step " in err and "it was stopped: SIGSTOP" in err, err
    assert "rank 0" not in err  # the healthy rank, waiting in all_reduce, is not blamed
    job = _job_dir(tmp_path)
    events = _events(job)
    stacks = _one(events, "stacks")
    assert stacks["behind"] == [1]
    assert stacks["ranks"]["1"]["stopped"] and not stacks["ranks"]["0"]["stopped"]
    for rank in ("0", "1"):
        with open(stacks["ranks"][rank]["file"]) as f:
            text = f.read()
        assert "(most recent call first):" in text and "train_loop.py" in text, text
    assert "all_reduce" in stacks["ranks"]["0"]["top_frame"]
    failure = _one(events, "failure")
    assert (failure["rank"], failure["cause"], failure["exit_code"]) == (1, "hang", 124)
    assert failure["detected_t"] - failure["fault_t"] >= 5
    assert os.path.exists(os.path.join(job, "error-rank1.json"))
    assert not os.path.exists(os.path.join(job, "error-rank0.json"))
    assert_no_job_process(tag)


def _path_with_py_spy(wanted: bool) -> str:
    """PATH without any py-spy, plus the venv's (a dev dependency) when ``wanted``."""
    here = os.path.dirname(sys.executable)
    assert not wanted or os.path.exists(os.path.join(here, "py-spy")), "py-spy is a dev dependency: make setup"
    dirs = [d for d in os.environ["PATH"].split(os.pathsep) if d and not os.path.exists(os.path.join(d, "py-spy"))]
    return os.pathsep.join([here, *dirs] if wanted else dirs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("py_spy", [True, False], ids=["py-spy", "no-py-spy"])
def test_a_rank_without_faulthandler_is_read_by_py_spy_or_a_note_says_why_not(tmp_path, free_port, py_spy):
    tag = new_tag()
    proc = _start(tmp_path, free_port, "--hang_timeout", "3", tag=tag, PLAIN_RANK="1",
                  PATH=_path_with_py_spy(py_spy))
    pids = _pids(proc)
    time.sleep(2.0)  # rank 0 beats its first steps (rank 1 never beats: it is never judged itself)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        os.kill(pids[1], signal.SIGCONT) if proc.returncode is None else None
    assert proc.returncode == 124, err
    events = _events(_job_dir(tmp_path))
    rank1 = _one(events, "stacks")["ranks"]["1"]
    notes = [e["text"] for e in events if e["kind"] == "note" and "no stack could be taken" in e["text"]]
    if py_spy:
        assert rank1["via"] == "py-spy" and not notes, (rank1, notes)
        with open(rank1["file"]) as f:
            assert "train_loop.py" in f.read()
        assert re.search(r"train_loop\.py:\d+ in main$", rank1["top_frame"]), rank1  # py-spy's frames parsed
    else:
        assert rank1["file"] is None and rank1["via"] is None, rank1
        assert notes == ["no stack could be taken for 1 rank(s): rank 1: no faulthandler registered (the script "
                         "does not use dslaunch's runtime) and no py-spy on PATH"], notes
    assert_no_job_process(tag)


@pytest.mark.timeout(120)
def test_exception_in_one_rank_error_file_has_the_traceback_root_cause_first(tmp_path, free_port):
    tag = new_tag()
    proc = _start(tmp_path, free_port, tag=tag, FAIL_RANK="1", FAIL_AT="3")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "rank 1 on localhost raised RuntimeError: bad batch at step 3" in err
    job = _job_dir(tmp_path)
    with open(os.path.join(job, "error-rank1.json")) as f:
        record = json.load(f)
    assert record["cause"] == "exception" and record["root_cause"] and record["step"] == 2
    tb = record["traceback"]
    assert tb.startswith("Traceback (most recent call last):")
    assert tb.index("ValueError: the root cause at step 3") < tb.index("RuntimeError: bad batch at step 3")
    failure = _one(_events(job), "failure")
    assert failure["rank"] == 1 and failure["exception"] == "RuntimeError: bad batch at step 3"
    assert_no_job_process(tag)


@pytest.mark.timeout(120)
def test_out_of_memory_is_named_with_its_remedies(tmp_path, free_port):
    proc = _start(tmp_path, free_port, tag=new_tag(), FAIL_RANK="0", FAIL_AT="2", FAIL_WITH="oom")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "OutOfMemoryError: CUDA out of memory" in err and "try a higher ZeRO stage" in err, err
    failure = _one(_events(_job_dir(tmp_path)), "failure")
    assert failure["cause"] == "oom" and "offload" in failure["remedy"]


@pytest.mark.timeout(120)
def test_custom_loop_heartbeats_reach_the_log_and_status_reads_it(tmp_path, free_port):
    proc = _start(tmp_path, free_port, tag=new_tag(), STEPS="20")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    job = _job_dir(tmp_path)
    events = _events(job)
    assert [e["kind"] for e in events][:1] == ["start"] and events[-1]["kind"] == "end"
    summary = [e for e in events if e["kind"] == "summary"][-1]
    assert summary["step"] == 20 and summary["ranks_up"] == 2 and summary["world"] == 2
    assert summary["memory"]["kind"] == "rss" and summary["memory"]["peak"] >= summary["memory"]["used"] > 0
    assert summary["samples_per_s"] > 0 and 0 < summary["loss"] <= 1
    status = subprocess.run([*DSLAUNCH, "status", str(tmp_path / "logs")], capture_output=True, text=True,
                            timeout=30)
    assert status.returncode == 0, status.stderr
    assert "state: finished, exit code 0" in status.stdout and "step 20" in status.stdout, status.stdout


@pytest.mark.timeout(60)
def test_status_of_a_failed_job_puts_the_root_cause_first(tmp_path, free_port):
    proc = _start(tmp_path, free_port, tag=new_tag(), FAIL_RANK="1", FAIL_AT="30", FAIL_WITH="exit=7")
    proc.communicate(timeout=60)
    assert proc.returncode == 7
    r = subprocess.run([*DSLAUNCH, "status", _job_dir(tmp_path)], capture_output=True, text=True, timeout=30)
    lines = r.stdout.splitlines()
    assert "state: finished, exit code 7" in lines[2], r.stdout
    cause = next(i for i, line in enumerate(lines) if line.startswith("root cause: "))
    # os._exit: no last beat flushed, so the step is the last one sent (steps take ~0.05 s)
    assert re.fullmatch(r"root cause: rank 1 on localhost exited with code 7 \(last reported step (\d+)\)", lines[cause]), r.stdout
    assert "error file: " in lines[cause + 2] and lines[cause + 2].endswith("error-rank1.json")


def test_status_without_a_log_is_one_line(tmp_path):
    r = subprocess.run([*DSLAUNCH, "status", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no events.jsonl there" in r.stderr, r.stderr


if sys.platform != "linux":  # pipes, /proc and signals as on Linux
    pytestmark = pytest.mark.skip("Linux only")


@pytest.mark.timeout(180)
def test_the_engine_reports_its_steps_without_the_script_doing_anything(tmp_path, free_port):
    """scripts/examples/train.py (ZeRO-2 through dslaunch.initialize) never calls heartbeat."""
    args = [*DSLAUNCH, "--num_gpus", "2", "--master_port", str(free_port), "--log_dir", str(tmp_path / "logs"),
            str(ROOT / "scripts" / "examples" / "train.py"), "--steps", "8", "--deepspeed_config",
            str(ROOT / "scripts" / "examples" / "ds_config.json")]
    r = subprocess.run(args, env=tagged_env(new_tag()), capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stderr
    summary = [e for e in _events(_job_dir(tmp_path)) if e["kind"] == "summary"][-1]
    assert summary["step"] == 8 and summary["slowest_step"] == 8 and summary["ranks_up"] == 2
    assert summary["samples_per_s"] > 0 and summary["loss"] > 0  # global samples (batch 64 per step)
