"""``hosts.held_by_an_ancestor``: a test run under ``flock CLUSTER_LOCK pytest ...`` (as the cluster
conftests ask) must not wait on its own ancestor's lock; another process's lock is still waited on."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.launcher.runners.hosts import ROOT, lock_holders

ASK = ("import sys; from tests.launcher.runners.hosts import held_by_an_ancestor; "
       "print(held_by_an_ancestor(open(sys.argv[1], 'w')))")

HOLD = "import fcntl, sys, time; f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); time.sleep(60)"


def _holders(path: str) -> set[int]:
    with open(path) as lock:
        return lock_holders(lock)


def _ask(*prefix: str, path: str) -> str:
    out = subprocess.run([*prefix, sys.executable, "-c", ASK, path], capture_output=True, text=True,
                         cwd=ROOT, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(60)
def test_a_lock_held_by_an_ancestor_counts_as_held_and_a_sibling_holder_does_not(tmp_path):
    path = str(tmp_path / "lock")
    assert _ask("flock", path, path=path) == "True"  # flock(1) holds it, its child asks
    assert _ask(path=path) == "False"  # nobody holds it
    holder = subprocess.Popen([sys.executable, "-c", HOLD, path])  # a sibling of the asker, not its ancestor
    try:
        while not _holders(path):
            assert holder.poll() is None
            time.sleep(0.02)
        assert _ask(path=path) == "False"
    finally:
        holder.kill()
        holder.wait()
