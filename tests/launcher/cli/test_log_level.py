"""DeepSpeed's ``--log_level`` and ``-q/--quiet`` on the launch command: which of the launcher's own
lines appear (notes at info, restarts at warning, the failure line always), worker output never
filtered, and the same flags on DeepSpeed's per-node ``launch`` module."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.distributed import free_port
from tests.launcher.helpers import FAKE, ROOT, run_dslaunch

pytestmark = pytest.mark.timeout(90)

# Rank 1 fails in the first run only: one restart, then the job ends well. In a second variant it
# fails every run, so the job ends with its exit code.
_ONCE = ["--num_gpus", "2", "--max_restarts", "1", FAKE, "print=work{rank}", "eprint=err{rank}", "c0:r1:exit=3"]
_ALWAYS = ["--num_gpus", "2", FAKE, "print=work{rank}", "r1:exit=3"]


def _launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("dslaunch: ")]


@pytest.mark.parametrize("flags, note, restart, started", [
    ([], True, True, True),
    (["--log_level", "warning"], False, True, False),
    (["--log_level", "error"], False, False, False),
    (["-q", "--log_level", "debug"], False, False, False),  # --quiet wins, as DeepSpeed's alias
])
def test_launcher_lines_follow_the_level(flags, note, restart, started):
    r = run_dslaunch([*flags, *_ONCE])
    assert r.returncode == 0, r.stderr
    lines = _launcher_lines(r.stderr)
    assert any("no GPU" in line for line in lines) == note, lines
    assert any("rank 1" in line and "exited with code 3" in line for line in lines) == restart, lines
    assert any("restart 1 started" in line for line in lines) == started, lines
    # the workers' own lines whatever the level: the failing rank's in both runs (rank 0 may be
    # stopped before it prints in the first), rank 0's in the second
    out = r.stdout.splitlines()
    assert out.count("[rank1] work1") == 2 and out.count("[rank0] work0") >= 1, r.stdout
    assert r.stderr.count("[rank1] err1") == 2, r.stderr


def test_the_failure_line_survives_quiet():
    r = run_dslaunch(["-q", *_ALWAYS])
    lines = _launcher_lines(r.stderr)
    assert r.returncode == 3 and len(lines) == 1 and lines[0].startswith("dslaunch: error: "), r.stderr
    assert "rank 1" in lines[0], lines


def test_deepspeeds_launch_module_takes_the_same_flags():
    world = "eyJsb2NhbGhvc3QiOiBbMCwgMV19"  # base64 of {"localhost": [0, 1]}
    for flags, noted in (([], True), (["--quiet"], False), (["--log_level=warning"], False)):
        base = [sys.executable, "-m", "dslaunch.launcher.launch", f"--world_info={world}", f"--master_port={free_port()}"]
        r = subprocess.run([*base, *flags, FAKE, "print=ok{rank}"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT)
        assert r.returncode == 0 and r.stdout.count("ok") == 2, r.stdout + r.stderr
        assert any("starting node 0 of 1" in line for line in _launcher_lines(r.stderr)) == noted, (flags, r.stderr)
