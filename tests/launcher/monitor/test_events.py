"""The event log never decides the job's exit code: a log that cannot be written (a full disk,
here the controller's RLIMIT_FSIZE: every write past the limit fails with EFBIG) is said once,
and the job ends with its own code."""

from __future__ import annotations

import compileall
import json
import os
import resource
import signal
import subprocess

import pytest

from dslaunch.launcher.monitor.events import EVENTS_FILE
from tests.launcher.helpers import DSLAUNCH, FAKE, ROOT, new_tag, on_free_port, tagged_env

pytestmark = pytest.mark.timeout(60)


def _compiled() -> None:
    """Every module's bytecode written now: a process under the limit (the watchdog runs with
    ``-I``, whatever PYTHONDONTWRITEBYTECODE says) would rename a .pyc cut short into place."""
    for package in ("launcher", "dslaunch"):
        assert compileall.compile_dir(str(ROOT / package), quiet=1)


def _small_files(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.mark.parametrize("actions, code", [(["print=ok"], 0), (["r1:exit=3"], 3)])
def test_a_full_log_disk_keeps_the_jobs_exit_code(tmp_path, actions, code):
    logs = tmp_path / "logs"
    _compiled()
    r = subprocess.run([*DSLAUNCH, *on_free_port(["--num_gpus", "2", "--log_dir", str(logs), FAKE, *actions])],
                       env=tagged_env(new_tag()), capture_output=True, text=True, timeout=30,
                       preexec_fn=_small_files(200))
    assert r.returncode == code, r.stderr
    assert "Traceback" not in r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("dslaunch: warning: cannot write")]
    assert len(warnings) == 1 and "File too large; the job goes on" in warnings[0], r.stderr
    (job,) = logs.iterdir()
    for name in os.listdir(job):  # what is there is whole: no empty or torn error file
        assert name == EVENTS_FILE or json.loads((job / name).read_text()), name

