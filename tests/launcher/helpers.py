"""Shared helpers for launcher tests: run dslaunch, find every process of a job by a tag."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "launcher" / "bin" / "fake_worker.py")
ALLREDUCE = str(ROOT / "scripts" / "examples" / "allreduce.py")
DSLAUNCH = [sys.executable, "-m", "dslaunch.launcher.cli"]
TAG_VAR = "DSLAUNCH_TEST_TAG"


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


def run_dslaunch(args: list[str], tag: str | None = None, timeout: float = 30, cwd: str | None = None,
                 **env: str) -> subprocess.CompletedProcess:
    """Run ``dslaunch ARGS`` to completion, capturing stdout/stderr as text."""
    return subprocess.run(DSLAUNCH + args, env=tagged_env(tag or new_tag(), **env), capture_output=True,
                          text=True, timeout=timeout, cwd=cwd)


def start_dslaunch(args: list[str], tag: str, cwd: str | None = None, **env: str) -> subprocess.Popen:
    return subprocess.Popen(DSLAUNCH + args, env=tagged_env(tag, **env), stdout=subprocess.PIPE,
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
