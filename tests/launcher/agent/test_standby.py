"""A standby agent (``agent.bootstrap --standby N``, what a Ray node's actor keeps for the next
run): its workers start in the warm spares it made before the request came; EOF before the
request ends it and its spares."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest

from dslaunch.launcher.agent.bootstrap import PROBE_MARKER, STANDBY
from dslaunch.launcher.agent.wire import parse_status_line
from dslaunch.launcher.spec import NodeSpec, WorkerSpec

pytestmark = pytest.mark.slow

SCRIPT = "import os, sys; print('warm' if 'torch' in sys.modules else 'cold', os.getpid(), flush=True)"


def _standby(spares: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dslaunch.launcher.agent.bootstrap", STANDBY, str(spares)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _spares(proc: subprocess.Popen, count: int) -> list[psutil.Process]:
    deadline = time.monotonic() + 30
    while len(found := psutil.Process(proc.pid).children()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


@pytest.mark.timeout(90)
def test_a_standby_agent_runs_its_workers_in_the_spares_it_made_before_the_request(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    proc = _standby(1)
    try:
        (spare,) = _spares(proc, 1)
        time.sleep(0.5)  # the request comes later: the agent waits for it
        assert proc.poll() is None
        proc.stdin.write(json.dumps({"cwd": str(tmp_path), "script": str(script)}).encode() + b"\n")
        proc.stdin.flush()
        probe = proc.stdout.readline().decode()
        assert probe.startswith(PROBE_MARKER) and json.loads(probe[len(PROBE_MARKER):])["pid"] == proc.pid
        worker = WorkerSpec(0, 0, (sys.executable, "-u", str(script)), {"RANK": "0", "LOCAL_RANK": "0"})
        proc.stdin.write(NodeSpec(0, "here", (worker,), cwd=str(tmp_path)).to_json().encode() + b"\n")
        proc.stdin.flush()
        out = proc.stdout.readline().decode()
        err = proc.stderr.read().decode()  # the agent exits once its worker did (the status line last)
        assert proc.wait(timeout=60) == 0, err
    finally:
        proc.kill()
    assert out.split() == ["[rank0]", "warm", str(spare.pid)], out  # the spare ran it: torch was there before
    assert not spare.is_running()
    assert parse_status_line(err.splitlines()[-1].encode() + b"\n").exit_code == 0, err


def test_eof_before_the_request_ends_the_standby_and_its_spares():
    proc = _standby(2)
    spares = _spares(proc, 2)
    assert len(spares) == 2
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0 and proc.stdout.read() == b""
    gone, alive = psutil.wait_procs(spares, timeout=10)
    assert not alive
