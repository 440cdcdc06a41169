"""``dslaunch ssh`` (DeepSpeed's ``ds_ssh``) without hosts to reach: its mistakes are one line each,
and a host that refuses the connection is named with exit 255. The command on real hosts:
``tests/launcher/runners/ssh/test_every_host.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port

pytestmark = pytest.mark.timeout(60)


def _ssh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dslaunch.launcher.cli", "ssh", *args], capture_output=True,
                          text=True, timeout=30)


def _hostfile(tmp_path: Path, text: str, name: str = "hosts") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_mistakes_are_one_line(tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, "127.0.0.1 slots=1\n")
    cases = [
        (["-f", str(tmp_path / "missing"), "true"], f"{tmp_path / 'missing'}: hostfile not found"),
        (["-f", _hostfile(tmp_path, "127.0.0.1 slots=x\n", "bad"), "true"], "bad:1: slots='x' is not an integer"),
        (["-f", hosts], "Missing argument 'COMMAND...'"),
        (["-f", hosts, "--include", "elsewhere", "true"], "elsewhere"),
    ]
    for args, says in cases:
        proc = _ssh(*args)
        lines = proc.stderr.splitlines()
        assert proc.returncode not in (0, 255) and len(lines) == 1 and lines[0].startswith("dslaunch: error: "), lines
        assert says in lines[0] and "Traceback" not in proc.stderr, (args, lines)


def test_a_refused_connection_is_exit_255_naming_the_host(tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, "127.0.0.1 slots=1\nlocalhost slots=2\n")
    proc = _ssh("-H", hosts, "--ssh_port", str(free_port()), "echo", "never")
    assert proc.returncode == 255 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.splitlines()
    for host in ("127.0.0.1", "localhost"):
        assert any(line.startswith(f"{host}: dslaunch: connection refused by ") for line in lines), lines
    assert lines[-1] == "dslaunch ssh: 2 of 2 host(s) failed: 127.0.0.1 (exit 255), localhost (exit 255)", lines
