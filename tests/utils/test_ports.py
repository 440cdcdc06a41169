"""``dslaunch.utils.ports``: a usable free port, torch-free, and the runtime never imports the launcher."""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
from pathlib import Path

from dslaunch.utils.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def test_free_port_can_be_bound() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_free_port_is_never_one_the_kernel_hands_out_itself() -> None:
    """Below the ephemeral range: no client or listening socket numbered by the kernel (gloo opens
    many) can take it before the rendezvous binds it, which cost a CI run an EADDRINUSE."""
    start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(50)}
    assert all(1024 <= p < start for p in ports), sorted(ports)
    assert len(ports) > 40  # drawn afresh each time, not one port handed to every caller


def test_a_port_range_from_the_environment_is_drawn_from_and_a_bad_one_is_one_line(monkeypatch) -> None:
    import pytest

    from dslaunch.utils import ports

    monkeypatch.setenv(ports.PORT_RANGE_ENV, "23000-23010")
    assert {free_port() for _ in range(30)} <= set(range(23000, 23010))
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "23010-23000")
    with pytest.raises(ValueError, match=r"^DSLAUNCH_PORT_RANGE: expected LOW-HIGH with 1024 <= LOW < HIGH"):
        free_port()


def test_importing_it_imports_no_torch() -> None:
    code = "import sys, dslaunch.utils.ports; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_runtime_never_imports_the_launcher() -> None:
    offenders = []
    for path in sorted((ROOT / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                          if n.startswith("dslaunch.launcher")]
    assert not offenders, offenders
