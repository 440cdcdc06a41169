"""The watchdog is a fresh interpreter (not a fork of a process with threads), kills the groups it
was told about when its owner goes away without a word, and leaves them alone after release()."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from dslaunch.launcher.agent.watchdog import Watchdog
from dslaunch.safe_write import write_new

pytestmark = pytest.mark.timeout(30)


def _group() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"], start_new_session=True)


def _gone(proc: subprocess.Popen, within: float = 5.0) -> bool:
    try:
        proc.wait(within)
        return True
    except subprocess.TimeoutExpired:
        return False


def _cmdline(pid: int) -> bytes:
    """The kernel fills it in a moment after the exec (Popen may return before): ask again."""
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            text = f.read()
        if text or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def test_an_owner_gone_without_release_gets_its_groups_killed_and_its_files_removed(tmp_path):
    worker, path = _group(), str(tmp_path / "1.deepspeed")
    dog = Watchdog()
    dog.start(remove=[(path, write_new(path, b"1"))])
    assert b"dslaunch.launcher.agent.watchdog" in _cmdline(dog.pid)  # exec'ed, not a fork of this process
    dog.add(worker.pid)
    os.close(dog._fd)  # what the kernel does for a SIGKILLed owner
    assert _gone(worker) and worker.returncode == -9
    deadline = time.monotonic() + 5
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not os.path.exists(path)


def test_release_leaves_the_groups_alone():
    worker = _group()
    dog = Watchdog()
    dog.start()
    dog.add(worker.pid)
    dog.release()  # waits for the watchdog to exit
    assert not _gone(worker, 0.3)
    worker.kill()
    worker.wait()
