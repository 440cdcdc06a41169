"""Shared helpers for launcher tests: run dslaunch (on a free port), find every process of a job by a tag."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from dslaunch.launcher.cli import SUBCOMMANDS
from dslaunch.utils.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "launcher" / "bin" / "fake_worker.py")
ALLREDUCE = str(ROOT / "scripts" / "examples" / "allreduce.py")
DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher.cli"]
TAG_VAR = "DSLAUNCH_TEST_TAG"

# A failing rank's job is stopped within the grace period + ~0.1 s on an idle machine (README:
# "within 2 s" at the default 1 s; measured in BENCHMARKS' fault recovery rows). On a machine at
# load 10 the launcher, agents and workers each wait for a core: tests allow this much more, still
# less than the slower ways a stop could happen (a host silent for 5 s, an agent for 10 s).
STOP_SLACK_S = 3.0


def new_tag() -> str:
    return uuid.uuid4().hex


def tagged_env(tag: str, **extra: str) -> dict[str, str]:
    """The environment for a dslaunch run whose processes (workers, grandchildren) carry ``tag``."""
    env = {**os.environ, TAG_VAR: tag, "OMP_NUM_THREADS": "1", **extra}
    return env


def job_processes(tag: str) -> list[psutil.Process]:
    """Every live (non-zombie) process whose environment carries ``tag``."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(TAG_VAR) == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_no_job_process(tag: str, within: float = 1.0) -> None:
    """Fail if any process of the job is still alive after ``within`` seconds."""
    deadline = time.monotonic() + within
    while (left := job_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of the job remain: {[(p.pid, p.cmdline()) for p in left]}"


def on_free_port(args: list[str]) -> list[str]:
    """``args`` with ``--master_port <a free port>`` in front when they launch a job and name no port.

    The default, 29500, may be held by another program on a shared machine, and dslaunch then
    rightly refuses to start: no test may depend on it being free. Left alone: subcommands, dry
    runs (they bind nothing and show the default) and launches that name their port.
    """
    if not args or args[0] in SUBCOMMANDS or args[0] == "sbatch":
        return args
    if any(a in ("--dry-run", "--dry_run", "--master_port") or a.startswith("--master_port=") for a in args):
        return args
    return ["--master_port", str(free_port()), *args]


def own_network() -> list[str]:
    """A command prefix that runs the command in a network namespace of its own (loopback down),
    where port 29500 is free whatever this machine's other programs hold: for the tests of the
    default port. Skips the test where this user cannot make one."""
    for prefix in (["unshare", "--net"], ["unshare", "--user", "--map-root-user", "--net"]):
        if shutil.which(prefix[0]) and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("needs a network namespace of its own (unshare --net) for a launch on the default port")


def run_dslaunch(args: list[str], tag: str | None = None, timeout: float = 30, cwd: str | None = None,
                 **env: str) -> subprocess.CompletedProcess:
    """Run ``dslaunch ARGS`` to completion (on a free port: ``on_free_port``), capturing stdout/stderr
    as text."""
    return subprocess.run(DSLAUNCH + on_free_port(args), env=tagged_env(tag or new_tag(), **env),
                          capture_output=True, text=True, timeout=timeout, cwd=cwd)


def start_dslaunch(args: list[str], tag: str, cwd: str | None = None, **env: str) -> subprocess.Popen:
    """Start ``dslaunch ARGS`` (on a free port: ``on_free_port``) with text pipes for stdout/stderr."""
    return subprocess.Popen(DSLAUNCH + on_free_port(args), env=tagged_env(tag, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=cwd)


def wait_for_lines(proc: subprocess.Popen, count: int, timeout: float = 10) -> list[str]:
    """Read ``count`` stdout lines from ``proc`` (e.g. 'ready' lines printed by workers)."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while len(lines) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
    assert len(lines) == count, f"expected {count} lines, got {lines}"
    return lines
