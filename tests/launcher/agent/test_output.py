"""Rank-prefixed output copying: whole lines, progress-bar redraws, unterminated tails."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dslaunch.launcher.agent.output import ExceptionWatch, Sink, pump

pytestmark = pytest.mark.timeout(60)


def _run(chunks: list[bytes]) -> tuple[bytes, bytes]:
    """Feed ``chunks`` through a pipe into pump(); return (sink bytes, log bytes)."""
    src_r, src_w = os.pipe()
    out_r, out_w = os.pipe()
    log_r, log_w = os.pipe()
    sink, log = Sink(out_w), Sink(log_w)
    t = threading.Thread(target=pump, args=(os.fdopen(src_r, "rb"), b"[rank7] ", sink, log))
    t.start()
    for c in chunks:
        os.write(src_w, c)
    os.close(src_w)
    t.join(10)
    sink.close()
    log.close()
    with os.fdopen(out_r, "rb") as o, os.fdopen(log_r, "rb") as g:
        return o.read(), g.read()


def test_lines_carriage_returns_and_unterminated_tail():
    out, log = _run([b"a\nb", b"c\n10%\r20%", b"\r\r", b"\nend"])
    assert out == b"[rank7] a\n[rank7] bc\n[rank7] 10%\r[rank7] 20%\r[rank7] \r\n[rank7] end\n"
    assert log == b"a\nbc\n10%\r20%\r\r\nend\n"


def test_torchs_own_rank_mark_is_not_repeated_on_the_console():
    out, log = _run([b"[rank7]: Traceback (most recent call last):\n", b"[rank3]: other\n", b"x [rank7]: y\n"])
    assert out == b"[rank7] Traceback (most recent call last):\n[rank7] [rank3]: other\n[rank7] x [rank7]: y\n"
    assert log.startswith(b"[rank7]: Traceback")  # the rank's own log keeps its bytes as written


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=8))
def test_every_byte_arrives_and_each_piece_is_prefixed(chunks):
    out, log = _run([c for c in chunks if c])
    data = b"".join(chunks)
    expected = data if not data or data.endswith((b"\n", b"\r")) else data + b"\n"
    assert log == expected
    assert out.replace(b"[rank7] ", b"") == expected
    assert out.count(b"[rank7] ") == log.count(b"\n") + log.count(b"\r") - log.count(b"\r\n")


def _watched(text: str) -> str | None:
    watch = ExceptionWatch()
    for line in text.splitlines(keepends=True):
        watch.feed(line.encode())
    return watch.exception


def test_exception_watch_takes_the_exception_line_of_the_last_traceback():
    text = ("warming up\n"
            "Traceback (most recent call last):\n"
            '  File "train.py", line 3, in <module>\n'
            "    step()\n"
            "    ^^^^^^\n"
            "KeyError: 'x'\n"
            "\nDuring handling of the above exception, another exception occurred:\n\n"
            "[rank1]: Traceback (most recent call last):\n"
            '[rank1]:   File "train.py", line 5, in <module>\n'
            "[rank1]: ValueError: bad batch\n"
            "[rank1]: second line of the message\n")
    assert _watched(text) == "ValueError: bad batch"


def test_exception_watch_ignores_output_without_a_traceback_and_bounds_the_line():
    assert _watched("loss 0.5\nValueError: printed, not raised\n") is None
    assert _watched("dslaunch: error: 'optimizer.params.lr': must be >= 0\n") == \
        "'optimizer.params.lr': must be >= 0"
    long = _watched("Traceback (most recent call last):\nRuntimeError: " + "x" * 5000 + "\n")
    assert long is not None and len(long) == ExceptionWatch.MAX_CHARS and long.endswith("...")


def test_exception_watch_keeps_the_whole_chained_traceback_original_exception_first():
    w = ExceptionWatch()
    printed = [
        "step 3", "Traceback (most recent call last):", '  File "t.py", line 5, in step', "    raise ValueError(x)",
        "ValueError: the root cause", "", "The above exception was the direct cause of the following exception:",
        "", "Traceback (most recent call last):", '  File "t.py", line 9, in <module>', "RuntimeError: bad batch",
        "after",
    ]
    for line in printed:
        w.feed(f"[rank1]: {line}\n".encode())
    assert w.exception == "RuntimeError: bad batch"
    assert w.traceback == "\n".join(printed[1:11])
    w.feed(b"Traceback (most recent call last):\n")  # a new, unrelated report replaces it when it ends
    w.feed(b"KeyError: 'x'\n")
    assert w.traceback == "Traceback (most recent call last):\nKeyError: 'x'"
