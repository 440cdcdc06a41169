"""The suite on a shared machine: another program may hold the default rendezvous port 29500. Test
launches take a free port (``helpers.on_free_port``); a launch that names none is refused in one line."""

from __future__ import annotations

import contextlib
import errno
import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.launcher.helpers import DSLAUNCH, FAKE, new_tag, on_free_port, run_dslaunch, tagged_env

DEFAULT_PORT = 29500


@contextlib.contextmanager
def _default_port_held(addr: str) -> Iterator[None]:
    """29500 listened on at ``addr``, by this test or by whoever holds it already."""
    with socket.socket() as s:
        try:
            s.bind((addr, DEFAULT_PORT))
            s.listen()
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
        yield


@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0"])
def test_a_test_launch_runs_while_another_program_holds_29500(addr: str) -> None:
    with _default_port_held(addr):
        r = run_dslaunch(["--num_gpus", "2", FAKE, "var=MASTER_PORT"], timeout=60)
    assert r.returncode == 0, r.stderr
    ports = {line.rpartition("=")[2] for line in r.stdout.splitlines()}
    assert len(ports) == 1 and ports != {str(DEFAULT_PORT)}, r.stdout


@pytest.mark.parametrize("addr", ["127.0.0.1", "0.0.0.0"])
def test_a_launch_naming_no_port_is_refused_while_29500_is_held(addr: str, tmp_path) -> None:
    marker = tmp_path / "started"
    with _default_port_held(addr):
        r = subprocess.run([*DSLAUNCH, "--num_gpus", "2", FAKE, f"grandchild={marker}"], env=tagged_env(new_tag()),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and not marker.exists(), r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dslaunch: error: --master_port {DEFAULT_PORT} is already in use"), r.stderr
    assert last.endswith("pick a free port with --master_port"), r.stderr


def test_on_free_port_adds_a_port_only_to_launches_that_name_none() -> None:
    launch = ["--num_gpus", "2", FAKE, "a"]
    flag, port, *rest = on_free_port(launch)
    assert (flag, rest) == ("--master_port", launch) and 0 < int(port) != DEFAULT_PORT
    for unchanged in (["--master_port", "4321", FAKE], ["--master_port=4321", FAKE], ["--dry-run", FAKE],
                      ["--num_gpus", "1", "--dry_run", FAKE], ["status", "logs"], ["estimate", "--help"],
                      ["sbatch", "--dry-run", FAKE], []):
        assert on_free_port(unchanged) == unchanged
