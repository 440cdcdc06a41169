"""dslaunch on one node, end to end: env contract, output, failure propagation, signals, no orphans.

Every job runs with a unique tag in its environment; ``assert_no_job_process`` then checks with
psutil that no process of the job (launcher, workers, grandchildren) is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.launcher.helpers import (
    ALLREDUCE,
    FAKE,
    STOP_SLACK_S,
    assert_no_job_process,
    job_processes,
    new_tag,
    run_dslaunch,
    start_dslaunch,
    tagged_env,
    wait_for_lines,
)

pytestmark = pytest.mark.timeout(60)


def _job(free_port: int, n: int, *actions: str, flags: tuple[str, ...] = ()) -> list[str]:
    return ["--num_gpus", str(n), "--master_port", str(free_port), *flags, FAKE, *actions]


def test_env_contract_prefixes_and_separate_streams(free_port):
    tag = new_tag()
    r = run_dslaunch(_job(free_port, 2, "env", "argv", "eprint=to-stderr-{rank}", "extra"), tag)
    assert r.returncode == 0, r.stderr
    out = sorted(r.stdout.splitlines())
    envs = [json.loads(line.split(" ", 1)[1]) for line in out if line.split(" ", 1)[1].startswith("{")]
    assert [line.split(" ", 1)[0] for line in out] == ["[rank0]", "[rank0]", "[rank1]", "[rank1]"]
    for rank, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (
            str(rank), str(rank), "2", "2")
        assert (env["NODE_RANK"], env["CROSS_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
            "0", "0", "127.0.0.1", str(free_port))
    argvs = [json.loads(line.split(" ", 1)[1]) for line in out if line.split(" ", 1)[1].startswith("[")]
    # DeepSpeed's order: --local_rank right after the script, then the user's arguments
    assert argvs == [[f"--local_rank={r}", "env", "argv", "eprint=to-stderr-{rank}", "extra"] for r in range(2)]
    assert "[rank0] to-stderr-0" in r.stderr and "[rank1] to-stderr-1" in r.stderr
    assert "to-stderr-0" not in r.stdout and "to-stderr-1" not in r.stdout
    assert_no_job_process(tag)


def test_no_local_rank_flag(free_port):
    r = run_dslaunch(_job(free_port, 1, "argv", flags=("--no_local_rank",)))
    assert json.loads(r.stdout.split(" ", 1)[1]) == ["argv"]


def test_first_failure_stops_all_and_sets_exit_code(free_port):
    tag = new_tag()
    t0 = time.monotonic()
    r = run_dslaunch(_job(free_port, 3, "r1:sleep=0.3", "r1:exit=7", "hang"), tag)
    assert r.returncode == 7
    assert "rank 1 on localhost exited with code 7" in r.stderr and "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 0.3 + 2 + 2  # failure + stop bound + startup slack on a busy machine
    assert_no_job_process(tag)


def test_failure_names_the_exception_the_rank_raised(free_port):
    r = run_dslaunch(_job(free_port, 2, "r1:raise=bad batch shape (4, 3)", "hang"))
    assert r.returncode == 1
    assert "rank 1 on localhost raised RuntimeError: bad batch shape (4, 3) (" in r.stderr
    assert "; stopped all other workers" in r.stderr


def test_signal_death_after_a_traceback_names_the_exception(free_port):
    # The abort of issue 8: a rank that already failed dies by SIGABRT in teardown. The job exits 1,
    # as the uncaught exception would have ended it; the line still tells the signal.
    r = run_dslaunch(_job(free_port, 2, "r1:atexit_signal=SIGABRT", "r1:raise=loss is nan", "hang"))
    assert r.returncode == 1
    assert ("rank 1 on localhost raised RuntimeError: loss is nan (then SIGABRT in its teardown: "
            "exit code 134)") in r.stderr


@pytest.mark.parametrize("sig, code", [("SIGKILL", 137), ("SIGSEGV", 139), ("SIGTERM", 143)])
def test_signal_death_is_never_exit_zero(free_port, sig, code):
    r = run_dslaunch(_job(free_port, 2, "r0:sleep=0.2", f"r0:signal={sig}", "hang"))
    assert r.returncode == code
    assert f"rank 0 on localhost was killed by {sig} (exit code {code})" in r.stderr


def test_workers_ignoring_sigterm_are_killed_after_the_grace_period(free_port):
    tag = new_tag()
    proc = start_dslaunch(_job(free_port, 3, "ignore_term", "print=ready", "r2:sleep=0.5", "r2:print=failing",
                               "r2:exit=3", "hang"), tag)
    wait_for_lines(proc, 3)
    wait_for_lines(proc, 1)  # rank 2 is about to exit 3
    t_fail = time.monotonic()
    assert proc.wait(timeout=10) == 3
    assert time.monotonic() - t_fail < 1.0 + STOP_SLACK_S  # the default grace period, on a busy machine
    assert_no_job_process(tag, within=0.5)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_dslaunch_stops_workers_and_grandchildren(free_port, tmp_path, sig):
    tag = new_tag()
    proc = start_dslaunch(_job(free_port, 2, f"grandchild={tmp_path}/gc{{rank}}", "print=ready", "hang"), tag)
    wait_for_lines(proc, 2)
    assert len(job_processes(tag)) >= 5  # launcher (+ watchdog), 2 workers, 2 grandchildren
    proc.send_signal(sig)
    assert proc.wait(timeout=5) == 128 + sig
    assert f"stopped by {signal.Signals(sig).name}" in proc.stderr.read()
    assert_no_job_process(tag)


def test_sigkill_of_dslaunch_leaves_no_process(free_port, tmp_path):
    tag = new_tag()
    proc = start_dslaunch(_job(free_port, 2, f"grandchild={tmp_path}/gc{{rank}}", "ignore_term", "print=ready",
                               "hang"), tag)
    wait_for_lines(proc, 2)
    gc = [int((tmp_path / f"gc{r}").read_text()) for r in range(2)]
    proc.kill()
    proc.wait(timeout=5)
    assert_no_job_process(tag, within=2.0)
    assert not any(_alive(pid) for pid in gc)


def test_grandchild_of_a_successful_worker_is_cleaned_up(free_port, tmp_path):
    tag = new_tag()
    r = run_dslaunch(_job(free_port, 1, f"grandchild={tmp_path}/gc"), tag)
    assert r.returncode == 0
    assert_no_job_process(tag)


def test_each_rank_log_and_save_pid(free_port, tmp_path):
    logs = tmp_path / "logs"
    tag = new_tag()
    proc = start_dslaunch(_job(free_port, 2, "print=out{rank}", "eprint=err{rank}", "print=ready", "sleep=0.5",
                               flags=("--enable_each_rank_log", str(logs), "--save_pid")), tag)
    wait_for_lines(proc, 4)
    pid_file = f"/tmp/{proc.pid}.deepspeed"
    assert int(open(pid_file).read()) == proc.pid
    assert proc.wait(timeout=10) == 0
    assert not os.path.exists(pid_file)
    for rank in range(2):
        lines = (logs / f"rank{rank}.log").read_text().splitlines()
        assert sorted(lines) == sorted([f"out{rank}", f"err{rank}", "ready"])


def test_save_pid_never_writes_through_a_planted_link(free_port, tmp_path):
    """The attack of issue 8: a link planted at the next dslaunch's /tmp/<pid>.deepspeed."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    plant = ("import os, sys; from dslaunch.launcher import cli; "
             f"link = f'/tmp/{{os.getpid()}}.deepspeed'; os.symlink({str(victim)!r}, link); print(link, flush=True); "
             f"sys.exit(cli.main({_job(free_port, 1, 'print=started', flags=('--save_pid',))!r}))")
    r = subprocess.run([sys.executable, "-c", plant], env=tagged_env(new_tag()), capture_output=True, text=True,
                       timeout=30)
    link = r.stdout.splitlines()[0]
    try:
        assert r.returncode == 1 and "started" not in r.stdout
        *notes, error = r.stderr.splitlines()  # notes: "no GPU ..."
        assert error == (f"dslaunch: error: localhost: --save_pid: {link} already exists (left by an earlier "
                         "job, or put there by someone else); dslaunch neither follows nor reuses it: check "
                         "and remove it")
        assert all(n.startswith("dslaunch: no GPU") for n in notes), r.stderr
        assert victim.read_text() == "precious\n" and os.readlink(link) == str(victim)
    finally:
        os.unlink(link)


def test_save_pid_file_is_removed_when_dslaunch_is_sigkilled(free_port):
    tag = new_tag()
    proc = start_dslaunch(_job(free_port, 1, "print=ready", "hang", flags=("--save_pid",)), tag)
    wait_for_lines(proc, 1)
    pid_file = f"/tmp/{proc.pid}.deepspeed"
    assert int(open(pid_file).read()) == proc.pid
    proc.kill()
    proc.wait(timeout=5)
    assert_no_job_process(tag, within=2.0)
    assert not os.path.exists(pid_file)


def test_bind_cores_to_rank(free_port):
    n = len(os.sched_getaffinity(0))
    r = run_dslaunch(_job(free_port, n, "affinity", "env", flags=("--bind_cores_to_rank",)))
    assert r.returncode == 0, r.stderr
    by_rank: dict[str, list] = {}
    for line in r.stdout.splitlines():
        prefix, payload = line.split(" ", 1)
        by_rank.setdefault(prefix, []).append(json.loads(payload))
    cores = [by_rank[f"[rank{i}]"][0] for i in range(n)]
    assert sorted(c for cs in cores for c in cs) == sorted(os.sched_getaffinity(0))
    assert all(len(c) == 1 for c in cores)
    assert all(by_rank[f"[rank{i}]"][1]["OMP_NUM_THREADS"] == "1" for i in range(n))


def test_busy_master_port_is_reported_before_workers_start(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        marker = tmp_path / "started"
        r = run_dslaunch(["--num_gpus", "2", "--master_port", str(port), FAKE, f"grandchild={marker}"])
    assert r.returncode != 0 and not marker.exists()
    assert f"--master_port {port} is already in use" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 2  # the CPU note and the one-line error


def test_missing_script_is_one_line():
    r = run_dslaunch(["--num_gpus", "2", "no_such_script.py"])
    assert r.returncode == 2 and r.stderr.strip().endswith("not found (cwd: " + os.getcwd() + ")")
    assert "Traceback" not in r.stderr


@pytest.mark.timeout(90)
def test_real_gloo_allreduce_two_ranks(free_port):
    tag = new_tag()
    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), ALLREDUCE], tag, timeout=80)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.splitlines())
    assert len(lines) == 2 and lines[0].startswith("[rank0] rank 0/2") and lines[1].startswith("[rank1] rank 1/2")
    assert all("sum 3 (expected 3)" in line for line in lines)
    assert_no_job_process(tag)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("flags, target", [
    (("--module",), "tests.launcher.bin.fake_worker"),
    (("--no_python",), FAKE),
])
def test_module_and_no_python(free_port, flags, target):
    from tests.launcher.helpers import ROOT

    r = run_dslaunch(["--num_gpus", "2", "--master_port", str(free_port), *flags, target, "argv"], cwd=str(ROOT),
                     PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [f'[rank{i}] ["--local_rank={i}", "argv"]' for i in range(2)]


def test_daemon_that_left_the_process_group_is_cleaned_up(free_port, tmp_path):
    tag = new_tag()
    r = run_dslaunch(_job(free_port, 2, f"daemon={tmp_path}/d{{rank}}", "r1:sleep=0.3", "r1:exit=4"), tag)
    assert r.returncode == 4
    assert_no_job_process(tag)


def test_localhost_hostfile_with_include_selects_slots(free_port, tmp_path):
    hf = tmp_path / "hostfile"
    hf.write_text("localhost slots=4  # this machine\n")
    r = run_dslaunch(["-H", str(hf), "-i", "localhost:1,3", "--master_port", str(free_port), FAKE, "env"])
    assert r.returncode == 0, r.stderr
    envs = [json.loads(line.split(" ", 1)[1]) for line in r.stdout.splitlines()]
    assert sorted((e["RANK"], e["CUDA_VISIBLE_DEVICES"]) for e in envs) == [("0", "1,3"), ("1", "1,3")]
