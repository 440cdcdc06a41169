"""``dslaunch status`` on logs it did not write well: malformed, hostile or huge ``events.jsonl``
files give a bounded, escaped story (bad lines skipped and counted) or one error line, never a
traceback."""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dslaunch.launcher import cli
from dslaunch.launcher.monitor.status import SHOWN_EACH, controller_gone
from tests.launcher.helpers import FAKE, job_processes, new_tag, run_dslaunch, start_dslaunch, wait_for_lines

pytestmark = pytest.mark.timeout(120)

START = {"t": 1.0, "kind": "start", "job_id": "j1", "hosts": ["localhost"], "world_size": 2}
END = {"t": 9.0, "kind": "end", "exit_code": 3, "duration_s": 8.0}


def _log(directory, lines: list[bytes | dict]) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "events.jsonl"), "wb") as f:
        for line in lines:
            f.write((json.dumps(line).encode() if isinstance(line, dict) else line) + b"\n")
    return str(directory)


def _status(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["status", *args])
    return code, out.getvalue(), err.getvalue()


MALFORMED = [
    b'{"kind":"start"}',  # no t
    b'{"t":"now","kind":"note"}',
    b'{"t":1,"kind":7}',
    b'{"t":NaN,"kind":"note"}',
    b'{"t":1e999,"kind":"note"}',
    b'[1,2]',
    b'"text"',
    b'{"t":1,"kind":"start","hosts":"localhost"}',
    b'{"t":1,"kind":"start","world_size":[2]}',
    b'{"t":1,"kind":"end","duration_s":"long"}',
    b'{"t":1,"kind":"summary","ranks_up":1,"world":2,"step":"ten"}',
    b'{"t":1,"kind":"summary","ranks_up":1,"world":1,"memory":{"kind":"gpu","used":"1","peak":2}}',
    b'{"t":1,"kind":"summary","ranks_up":1,"world":1,"memory":{"kind":"rss","used":1' + b"0" * 400 + b',"peak":2}}',
    b'{"t":1,"kind":"failure","message":"m","fault_t":1,"detected_t":"later"}',
    b'{"t":1,"kind":"failure","error_files":[1]}',
    b'{"t":1,"kind":"stacks","behind":[1],"ranks":{"x":{}}}',
    b'{"t":1,"kind":"stacks","behind":["1"],"ranks":{}}',
    b'{"t":1,"kind":"stacks","ranks":{"1":{"top_frame":5}}}',
    b'{"t":1,"kind":"note","text":"\xff\xfe bad utf-8"}',
    '{"t":1,"kind":"note"}'.encode("utf-16"),
    b"[" * 100_000,
    b'{"t":1,"kind":"note","n":' + b"9" * 5000 + b"}",
    b"not json at all",
]


@pytest.mark.parametrize("line", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_line_is_skipped_and_counted(tmp_path, line):
    code, out, err = _status(_log(tmp_path / "job", [START, line, END]))
    assert (code, err) == (0, ""), err
    assert "state: finished, exit code 3 after 8.0 s" in out
    assert out.rstrip().endswith("(1 line(s) skipped: not valid events)"), out


def test_garbage_alone_is_one_line_not_a_running_job(tmp_path):
    code, out, err = _status(_log(tmp_path / "job", [b"garbage", b'{"kind":"start"}']))
    assert (code, out) == (2, "")
    assert err == (f"dslaunch: error: dslaunch status: {tmp_path}/job/events.jsonl holds no valid event "
                   "(2 line(s) skipped); give the --log_dir of a dslaunch job\n")


def test_without_a_start_the_state_is_unknown(tmp_path):
    code, out, _ = _status(_log(tmp_path / "job", [{"t": 1, "kind": "note", "text": "hi"}]))
    assert code == 0 and "state: unknown (no start event" in out and "state: running" not in out


def test_an_unreadable_job_file_is_one_line(tmp_path):
    (tmp_path / "job").mkdir()
    os.symlink("/proc/self/mem", tmp_path / "job" / "events.jsonl")  # a regular file whose reads fail
    code, out, err = _status(str(tmp_path))
    assert (code, out) == (2, "")
    assert err == (f"dslaunch: error: dslaunch status: cannot read {tmp_path}/job/events.jsonl: "
                   "Input/output error\n")


@pytest.mark.parametrize("args, words", [
    (["--bogus"], "dslaunch status: No such option '--bogus'. (see dslaunch status --help)"),
    (["a", "b"], "dslaunch status: Got unexpected extra argument (b)"),
])
def test_bad_options_are_one_line(args, words):
    r = run_dslaunch(["status", *args])
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"dslaunch: error: {words}") and len(r.stderr.splitlines()) == 1, r.stderr


def test_escape_sequences_in_the_log_never_reach_the_terminal(tmp_path):
    evil = "\x1b]0;owned\x07\x1b[2J\r\u2028"
    code, out, _ = _status(_log(tmp_path / "job", [
        START, {"t": 2, "kind": "note", "text": evil},
        {"t": 3, "kind": "failure", "message": evil, "error_files": [evil], "remedy": evil},
        {"t": 4, "kind": evil, evil: evil}, END]))
    assert code == 0
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "\u2028" not in out
    assert "root cause: \\x1b]0;owned\\x07\\x1b[2J\\r\\u2028" in out, out


def test_the_output_is_bounded_whatever_the_log_holds(tmp_path):
    notes = b"".join(b'{"t":2,"kind":"note","text":"%d"}\n' % i for i in range(200_000))
    ranks = {str(r): {"step": 1, "top_frame": "x" * 500} for r in range(1000)}
    directory = _log(tmp_path / "job", [START, {"t": 3, "kind": "stacks", "behind": list(range(1000)),
                                                "ranks": ranks}, END])
    with open(os.path.join(directory, "events.jsonl"), "ab") as f:
        f.write(notes)
    code, out, _ = _status(directory)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) < 60 and max(map(len, lines)) <= 300, (len(lines), max(map(len, lines)))
    assert "note: text='199999'" in out and f"({200_000 - SHOWN_EACH} earlier events not shown)" in out
    assert f"  ... and {1000 - SHOWN_EACH} more ranks" in out


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=4),
                     max_leaves=12)
_KIND = st.sampled_from(["start", "end", "summary", "failure", "stacks", "ranks_up", "note", "run_end"]) | st.text()
_FIELD = st.sampled_from(["job_id", "hosts", "world_size", "exit_code", "duration_s", "step", "samples_per_s",
                          "loss", "ranks_up", "world", "lagging", "slowest_rank", "slowest_step", "memory",
                          "message", "fault_t", "detected_t", "remedy", "error_files", "others", "behind",
                          "ranks", "text"]) | st.text(max_size=8)
_EVENT = st.fixed_dictionaries({"t": st.floats(allow_nan=False, allow_infinity=False) | _JSON, "kind": _KIND},
                               optional={"memory": st.fixed_dictionaries({"kind": st.text(max_size=4),
                                                                          "used": _JSON, "peak": _JSON}),
                                         "ranks": st.dictionaries(st.sampled_from(["0", "1", "x"]),
                                                                  st.dictionaries(_FIELD, _JSON, max_size=4))}
                               ).flatmap(lambda e: st.dictionaries(_FIELD, _JSON, max_size=6).map(
                                   lambda extra: {**extra, **e}))
_LINE = _EVENT.map(lambda e: json.dumps(e).encode()) | st.binary(max_size=40) | st.text(max_size=40).map(
    lambda t: t.encode("utf-8", "surrogatepass"))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(_LINE, max_size=25), newline_at_end=st.booleans())
def test_any_event_log_gives_a_bounded_escaped_story_or_one_line(lines, newline_at_end):
    with tempfile.TemporaryDirectory() as directory:
        with open(os.path.join(directory, "events.jsonl"), "wb") as f:
            f.write(b"\n".join(lines) + (b"\n" if newline_at_end else b""))
        code, out, err = _status(directory)
    if code == 0:
        assert err == ""
        assert all(line.isprintable() and len(line) <= 300 for line in out.splitlines()), out
        assert len(out.splitlines()) < 2000
    else:
        assert code == 2 and out == "" and len(err.splitlines()) == 1, err
        assert err.startswith("dslaunch: error: dslaunch status: ") and "holds no valid event" in err, err


def test_a_controller_killed_with_sigkill_is_not_shown_running(tmp_path, free_port):
    """No end event is written when the controller is SIGKILLed: the log alone would read
    "running" forever. Its start event names its pid and start time, checked from the same host."""
    tag = new_tag()
    proc = start_dslaunch(["--num_gpus", "1", "--master_port", str(free_port), "--log_dir", str(tmp_path),
                           FAKE, "print=ready", "hang"], tag)
    try:
        wait_for_lines(proc, 1, timeout=60)
        code, out, _ = _status(str(tmp_path))
        assert code == 0 and "state: running (last event" in out, out
        proc.kill()
        proc.wait(timeout=10)
        code, out, _ = _status(str(tmp_path))
        assert code == 0 and "state: ended without a word (last event" in out, out
        assert f"its controller, pid {proc.pid}, is gone (killed with SIGKILL, or the machine restarted)" in out
    finally:
        proc.kill()
        for p in job_processes(tag):
            p.kill()
    # A pid reused by another process is not the controller either.
    start = json.loads((next(tmp_path.iterdir()) / "events.jsonl").read_text().splitlines()[0])
    assert controller_gone({**start, "pid": os.getpid()})
    assert not controller_gone({**start, "host": "elsewhere"})  # cannot be told from here
