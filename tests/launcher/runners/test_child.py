"""``ChildSession`` (``launcher/runners/child.py``) with a plain local command: both streams are
read to their end before the exit is recorded (``AgentStream._follow``), the exit code or signal is
mapped as the runners read it, and the scratch directory is gone once ``done`` is set. The SLURM
and MPI runners built on it are tested on the namespace cluster (their own files)."""

from __future__ import annotations

import os
import threading

import pytest

from dslaunch.launcher.agent.output import Sink
from dslaunch.launcher.runners.child import ChildSession

pytestmark = pytest.mark.timeout(30)


def _run(script: str) -> tuple[ChildSession, bytes, str]:
    """Run ``sh -c script`` as a session; returns it once done, its prefixed stdout, and the scratch
    directory it was given."""
    read_fd, write_fd = os.pipe()
    chunks: list[bytes] = []
    drain = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 65536), b"")))
    drain.start()
    out = Sink(write_fd)
    session = ChildSession("h", ["sh", "-c", script], out, Sink(os.dup(2)), scratch_env="DSL_TEST_SCRATCH")
    session.start()
    assert session.done.wait(20), "the session never ended"
    scratch = session.scratch
    out.close()
    drain.join(10)
    os.close(read_fd)
    return session, b"".join(chunks), scratch


def test_every_line_is_read_before_the_exit_is_recorded() -> None:
    session, out, scratch = _run('i=0; while [ $i -lt 3000 ]; do echo "line $i"; i=$((i+1)); done; '
                                 'echo "scratch=$DSL_TEST_SCRATCH" >&2; exit 3')
    assert out.splitlines() == [f"h: line {i}".encode() for i in range(3000)]
    assert session.held_stderr(release=False) == f"scratch={scratch}\n"  # before any probe: held
    assert (session.exit_code, session.lost) == (3, True)  # no status line and not 0: lost
    assert scratch and not os.path.exists(scratch)


def test_a_command_killed_by_a_signal_exits_as_a_shell_reports_it() -> None:
    session, out, _ = _run("echo up; kill -TERM $$")
    assert out == b"h: up\n"
    assert (session.exit_code, session.lost) == (128 + 15, True)


def test_a_clean_exit_is_not_lost() -> None:
    session, out, _ = _run("true")
    assert (out, session.exit_code, session.lost) == (b"", 0, False)
