"""The MPI runners: one node agent per host through mpirun (Open MPI for real, on localhost here;
across namespace hosts in ssh/test_mpi_cluster.py), Hydra's command forms checked as text."""

from __future__ import annotations

import glob
import os
import shlex
import shutil
import tempfile
import time

import psutil
import pytest

from tests.launcher.helpers import (
    ROOT,
    assert_no_job_process,
    new_tag,
    run_dslaunch,
    start_dslaunch,
    wait_for_lines,
)

LOOP = str(ROOT / "tests" / "launcher" / "bin" / "train_loop.py")
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="no mpirun (make system-deps installs Open MPI)")


@pytest.fixture
def two_slots(tmp_path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("localhost slots=2\n")
    return str(path)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher, placement", [
    ("openmpi", ["-n", "1", "--host", "localhost", "--bind-to", "none"]),
    ("mpich", ["-n", "1", "-hosts", "localhost"]),
    ("impi", ["-n", "1", "-hosts", "localhost"]),
    ("mvapich", ["-n", "1", "-hosts", "localhost"]),
])
def test_dry_run_shows_one_mpirun_per_host_running_its_agent(two_slots, launcher, placement):
    out = run_dslaunch(["-H", two_slots, "--launcher", launcher, "--launcher_args", "--mca foo 1", "--dry-run",
                        LOOP])
    assert out.returncode == 0, out.stderr
    argv = shlex.split(out.stdout.splitlines()[0])
    argv = [a for a in argv if a != "--allow-run-as-root"]  # Open MPI's, when the tests run as root
    assert argv[:len(placement) + 4] == ["mpirun", *placement, "--mca", "foo", "1"]
    assert argv[-3:-1] == ["-m", "dslaunch.launcher.agent.bootstrap"]
    assert "RANK=1" in out.stdout and "WORLD_SIZE=2" in out.stdout  # the agent's workers, as over SSH
    assert ("OMPI_MCA_orte_local_tmpdir_base=<a private directory" in out.stdout) == (launcher == "openmpi")


@needs_mpirun
@pytest.mark.timeout(90)
def test_a_failing_rank_stops_the_job_and_is_named_with_its_exit_code(two_slots):
    tag = new_tag()
    out = run_dslaunch(["-H", two_slots, "--launcher", "openmpi", LOOP], tag=tag, timeout=80,
                       STEPS="200", FAIL_RANK="1", FAIL_AT="3", FAIL_WITH="exit=7")
    assert out.returncode == 7, out.stderr[-2000:]
    assert "rank 1 on localhost exited with code 7; stopped all other workers" in out.stderr
    assert "Primary job" not in out.stderr  # mpirun's own report of the same exit is not repeated
    assert_no_job_process(tag, within=5)


@needs_mpirun
@pytest.mark.timeout(90)
def test_a_job_through_mpirun_finishes_with_exit_0(two_slots):
    out = run_dslaunch(["-H", two_slots, "--launcher", "openmpi", LOOP], timeout=80, STEPS="5")
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(line.split()[1] for line in out.stdout.splitlines() if " pid " in line) == ["[rank0]", "[rank1]"]


def _mpirun_of(proc: psutil.Process, within: float = 20) -> psutil.Process:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        found = [p for p in proc.children(recursive=True) if p.name() == "mpirun"]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError("no mpirun under the controller")


@needs_mpirun
@pytest.mark.timeout(90)
def test_each_mpirun_keeps_its_session_directory_in_a_private_one_removed_after(two_slots):
    # Every mpirun of a user on a host shares /tmp/ompi.<host>.<uid>; one exiting removes it when it
    # looks empty while another is making its own directory there ("orte_session_dir failed").
    tag = new_tag()
    job = start_dslaunch(["-H", two_slots, "--launcher", "openmpi", LOOP], tag=tag, STEPS="100")
    try:
        wait_for_lines(job, 2, timeout=40)  # both ranks run: mpirun's session directory exists
        mpirun = _mpirun_of(psutil.Process(job.pid))
        private = mpirun.environ()["OMPI_MCA_orte_local_tmpdir_base"]
        assert os.path.dirname(private) == tempfile.gettempdir() and os.stat(private).st_mode & 0o777 == 0o700
        assert glob.glob(os.path.join(private, "ompi.*", f"pid.{mpirun.pid}"))
        assert not glob.glob(os.path.join(tempfile.gettempdir(), "ompi.*", f"pid.{mpirun.pid}"))
        assert job.wait(60) == 0, job.stderr.read()[-2000:]
    finally:
        if job.poll() is None:
            job.kill()
    assert not os.path.exists(private)
    assert_no_job_process(tag, within=5)
