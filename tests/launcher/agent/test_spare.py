"""Warm spare workers: a restarted run's workers start in interpreters that already imported torch,
and behave as freshly spawned ones (argv, cwd, environment, output, exit codes, the monitor's
heartbeats and hang report, no process left behind)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslaunch.launcher.agent.spare import Assignment, SpareLost, SparePool, runnable
from dslaunch.utils.ports import free_port
from tests.conftest import timeout_scale
from tests.launcher.helpers import assert_no_job_process, job_processes, new_tag, run_dslaunch, start_dslaunch

pytestmark = pytest.mark.slow
STRESS = Path(__file__).resolve().parents[3] / "scripts" / "spare_stress.py"

# Each run reports whether torch was imported before its first line (a spare) and what it was given.
SCRIPT = """
import os, signal, sys, time
warm = "torch" in sys.modules
import torch
import torch.distributed as dist
run = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"run={run} rank={rank} warm={warm} argv={sys.argv[1:]} cwd={os.getcwd()} main={__name__} "
      f"threads={torch.get_num_threads()} env={os.environ.get('SPARE_TEST')}")
t = torch.ones(2)
dist.all_reduce(t)
fault = sys.argv[-1]
while fault == "wait" and run == 0 and not os.path.exists("go"):
    time.sleep(0.1)
if run == 0 and rank == 1:
    os.kill(os.getpid(), signal.SIGKILL) if fault == "kill" else sys.exit(7)
if run == 1 and rank == 1 and fault == "raise":
    raise ValueError("bad batch in the restarted run")
if run == 1 and rank == 1 and fault == "hang":
    from dslaunch import heartbeat
    heartbeat(1)
    time.sleep(600)
dist.all_reduce(t)
dist.destroy_process_group()
"""


_FLAGS = ("--num_gpus", "2", "--max_restarts", "1", "--master_port", str(free_port()))


def test_runnable_takes_python_u_script_or_module_with_this_interpreter():
    py = sys.executable
    assert runnable([py, "-u", "train.py", "--x"]) and runnable([py, "-u", "-m", "pkg.train"])
    assert not runnable([py, "train.py"]) and not runnable([py, "-u", "-m"])
    assert not runnable(["/other/python", "-u", "train.py"]) and not runnable(["./train.sh"])


WARM_PROBE = """
import os, socket, threading
from dslaunch.launcher.agent import spare
seen = []
ours, theirs = socket.socketpair()
group_nice = lambda: open("/proc/self/autogroup").read().split()[-1] if os.path.exists("/proc/self/autogroup") else None
class Probe:  # stands in for importlib: records the policies while "importing"
    @staticmethod
    def import_module(name):
        if seen:  # the first import tells; by a later one the waiting thread may be gone (pool closed)
            return
        wake = next(t for t in threading.enumerate() if t.name == "spare-wake")
        seen.append((os.sched_getscheduler(0), os.sched_getscheduler(wake.native_id), group_nice()))
        ours.close()  # the pool closes: the waiting thread ends
spare.importlib = Probe
assert spare._warm(theirs, "token", delay=0) is None
print(seen[0][0] == os.SCHED_IDLE, seen[0][1] == os.SCHED_OTHER, os.sched_getscheduler(0) == os.SCHED_OTHER,
      seen[0][2] in ("19", None), group_nice() in ("0", None))
"""


@pytest.mark.timeout(60)
def test_a_spare_warms_up_at_idle_priority_with_a_normal_thread_to_wake_it():
    if not subprocess.run([sys.executable, "-c", "from dslaunch.launcher.agent.spare import _may_leave_idle as m; "
                           "raise SystemExit(0 if m() else 1)"]).returncode == 0:
        pytest.skip("this user may not leave SCHED_IDLE again (no CAP_SYS_NICE, RLIMIT_NICE too low)")
    done = subprocess.run([sys.executable, "-c", WARM_PROBE], capture_output=True, text=True, timeout=50,
                          start_new_session=True)  # a spare leads its session (and autogroup)
    # idle while importing, its autogroup too (else alone in it, it would take a whole group's
    # share); the thread that restores it on news is not idle (it could starve); normal after
    assert done.stdout.split() == ["True"] * 5, done.stdout + done.stderr


def _lines(out: str, run: int) -> dict[int, str]:
    found = {}
    for line in out.splitlines():
        if f"run={run} " in line:
            found[int(line.split("rank=")[1].split()[0])] = line
    return found


def _job(tmp_path, fault: str, *flags: str, tag: str | None = None, timeout: float = 100):
    (tmp_path / "job.py").write_text(SCRIPT)
    return run_dslaunch([*_FLAGS, "--log_dir", str(tmp_path / "logs"), *flags, "job.py", "a b", fault], tag=tag, cwd=str(tmp_path), timeout=timeout, SPARE_TEST="yes")


@pytest.mark.timeout(150)
def test_a_restarted_run_starts_in_warm_spares_given_everything_a_fresh_worker_gets(tmp_path):
    tag = new_tag()
    done = _job(tmp_path, "exit", tag=tag)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    first, second = _lines(out, 0), _lines(out, 1)
    assert set(first) == set(second) == {0, 1}, out[-3000:]
    assert all("warm=False" in line for line in first.values()), out[-3000:]
    for rank, line in second.items():
        assert line.startswith(f"[rank{rank}] run=1 rank={rank} warm=True "), out[-3000:]
        assert f"argv=['--local_rank={rank}', 'a b', 'exit'] cwd={tmp_path} main=__main__ threads=1 env=yes" in line
    assert_no_job_process(tag, within=5)  # the spares made for a third run are gone too


@pytest.mark.timeout(150)
def test_no_warm_spares_starts_restarted_workers_fresh(tmp_path):
    done = _job(tmp_path, "kill", "--no_warm_spares")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert all("warm=False" in line for line in _lines(out, 1).values()) and len(_lines(out, 1)) == 2, out[-3000:]


@pytest.mark.timeout(150)
def test_a_spare_worker_that_raises_is_blamed_with_its_exception_and_exit_code(tmp_path):
    done = _job(tmp_path, "raise")
    assert done.returncode == 1, done.stderr[-3000:]
    assert "warm=True" in _lines(done.stdout, 1)[1]
    assert "rank 1 on localhost raised ValueError: bad batch in the restarted run" in done.stderr
    # The traceback is the script's, as `python job.py` prints it: no frame of the spare or runpy.
    trace = done.stderr.split("[rank1] Traceback (most recent call last):")[-1].split("ValueError")[0]
    assert 'File "job.py", line' in trace and "spare.py" not in trace and "runpy" not in trace, done.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_spare_worker_reports_to_the_monitor_whose_hang_detection_names_it(tmp_path):
    done = _job(tmp_path, "hang", "--hang_timeout", "3")
    assert done.returncode == 124, done.stderr[-3000:]
    assert "warm=True" in _lines(done.stdout, 1)[1]
    assert "rank 1 on localhost hung" in done.stderr, done.stderr[-3000:]


@pytest.mark.timeout(150)
def test_a_worker_whose_spare_died_is_spawned_fresh(tmp_path):
    tag = new_tag()
    (tmp_path / "job.py").write_text(SCRIPT)
    proc = start_dslaunch([*_FLAGS, "job.py", "wait"], tag, cwd=str(tmp_path))
    spares = _spares(tag, 2, within=60)
    spares[0].kill()
    (tmp_path / "go").touch()
    out, err = proc.communicate(timeout=100)
    assert proc.returncode == 0, err[-3000:]
    assert sorted("warm=True" in line for line in _lines(out, 1).values()) == [False, True], out[-3000:]


def _spares(tag: str, count: int, within: float) -> list:
    """The job's spare processes, once ``count`` are up."""
    deadline = time.monotonic() + within
    while len(found := [p for p in job_processes(tag) if "agent.spare" in " ".join(p.cmdline())]) < count:
        assert time.monotonic() < deadline, f"{len(found)} spare(s) after {within} s"
        time.sleep(0.2)
    return found


@pytest.mark.timeout(120)
def test_spares_die_with_a_killed_launcher(tmp_path):
    (tmp_path / "job.py").write_text("import time\ntime.sleep(600)\n")
    tag = new_tag()
    proc = start_dslaunch([*_FLAGS, str(tmp_path / "job.py")], tag)
    _spares(tag, 2, within=60)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert_no_job_process(tag, within=10)


@pytest.mark.timeout(150)
def test_the_module_form_runs_in_a_spare(tmp_path):
    (tmp_path / "mod_job.py").write_text(SCRIPT)
    done = run_dslaunch([*_FLAGS, "--log_dir", str(tmp_path / "logs"), "--module", "mod_job", "x", "exit"], cwd=str(tmp_path), timeout=100, SPARE_TEST="m")
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert all("warm=True" in line and "main=__main__" in line for line in _lines(out, 1).values()), out[-3000:]


def _pipes(count: int) -> tuple[list[int], list[int]]:
    pairs = [os.pipe() for _ in range(count)]
    return [r for r, _ in pairs], [w for _, w in pairs]


@pytest.mark.timeout(60)
def test_a_spare_refuses_an_assignment_addressed_to_another_and_runs_none_of_it(tmp_path):
    """Each spare is started with a token and takes only what is addressed to it; one it refuses
    is reported to the agent (SpareLost), and the spare is gone, having run nothing."""
    (tmp_path / "job.py").write_text("open('ran', 'w').close()\n")
    argv = (sys.executable, "-u", "job.py")
    pool = SparePool(os.environ)
    pool.fill(1)
    spare = pool.take(argv)
    assert spare is not None and not pool.pids()  # taken once: it left the pool
    spare.token = "not-its-token"  # an assignment meant for another spare
    reads, writes = _pipes(4)
    try:
        with pytest.raises(SpareLost, match="refused: addressed to another spare"):
            spare.assign(Assignment(argv, dict(os.environ), str(tmp_path)), writes)
    finally:
        _close_all(reads + writes)
        pool.close()
    assert spare.proc.returncode is not None  # reaped before assign raised
    assert not (tmp_path / "ran").exists()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


@pytest.mark.timeout(240)
def test_spare_restarts_under_stress_hand_every_rank_to_its_own_spare(tmp_path):
    """The short version of scripts/spare_stress.py: SIGKILL restarts in a row, some while the next
    spares still import torch, one after a waiting spare was killed: no broken pipe, no fresh
    start while a spare was alive, no hang, each rank run once, by the process the agent started
    for it, in a spare never used before."""
    out = tmp_path / "stress.json"
    # 31 s on an idle machine, 108 s at load 36: the bounds (a hang guard, and what counts as a
    # hung run) grow with the load, as the test's own timeout does (tests/conftest.py).
    scale = timeout_scale(os.getloadavg()[0], os.cpu_count() or 1)
    done = subprocess.run([sys.executable, str(STRESS), "--restarts", "4", "--kill-spare-every", "4",
                           "--max-pause", "1", "--run-timeout", f"{40 * scale:.0f}", "--json", str(out)],
                          capture_output=True, text=True, timeout=220 * scale)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    counts = json.loads(out.read_text())["counts"]
    assert counts["restarts"] == 4 and counts["warm_ranks"] + counts["expected_fallbacks"] == 8, counts
