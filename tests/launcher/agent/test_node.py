"""The node agent: in-process and as ``python -m dslaunch.launcher.agent`` (what the SSH runner runs)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from dslaunch.errors import LaunchError
from dslaunch.launcher.agent.node import Agent
from dslaunch.launcher.agent.wire import (
    format_failure_line,
    format_status_line,
    parse_failure_line,
    parse_status_line,
)
from dslaunch.launcher.spec import NodeResult, NodeSpec, WorkerSpec
from tests.launcher.helpers import FAKE, assert_no_job_process, new_tag, tagged_env

pytestmark = pytest.mark.timeout(30)


def _node(n: int, *actions: str, grace: float = 1.5, argv0: tuple[str, ...] | None = None,
          **files: str) -> NodeSpec:
    head = argv0 or (sys.executable, FAKE)
    workers = tuple(WorkerSpec(10 + i, i, (*head, *actions), {"RANK": str(10 + i)}) for i in range(n))
    return NodeSpec(node_rank=3, host="hostA", workers=workers, grace=grace, **files)


def _agent_proc(node: NodeSpec, tag: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "dslaunch.launcher.agent"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=tagged_env(tag))
    proc.stdin.write((node.to_json() + "\n").encode())
    proc.stdin.flush()
    return proc


def _status(stderr: bytes) -> NodeResult:
    found = [r for line in stderr.splitlines() if (r := parse_status_line(line)) is not None]
    assert len(found) == 1, stderr
    return found[0]


def test_status_line_round_trip_and_other_lines_ignored():
    r = NodeResult(1, "h", 139, rank=5, signal_name="SIGSEGV")
    assert parse_status_line(format_status_line(r) + "\n") == r
    assert parse_status_line("[rank5] @@dslaunch-agent-status {}") is None
    assert parse_status_line("@@dslaunch-agent-status {not json") is None
    assert parse_failure_line(format_failure_line(r)) == r
    assert parse_status_line(format_failure_line(r)) is None and parse_failure_line(format_status_line(r)) is None


def test_agent_process_runs_to_completion_while_stdin_stays_open():
    tag = new_tag()
    proc = _agent_proc(_node(2, "print=hi{rank}", "r11:sleep=0.2", "r11:exit=9", "hang"), tag)
    proc.wait(timeout=10)
    res = _status(proc.stderr.read())
    assert (proc.returncode, res.rank, res.exit_code, res.host, res.node_rank) == (9, 11, 9, "hostA", 3)
    assert sorted(proc.stdout.read().decode().splitlines()) == ["[rank10] hi10", "[rank11] hi11"]
    proc.stdin.close()
    assert_no_job_process(tag)


def test_agent_stops_workers_when_stdin_closes():
    tag = new_tag()
    proc = _agent_proc(_node(2, "ignore_term", "print=ready", "hang", grace=0.3), tag)
    for _ in range(2):
        proc.stdout.readline()
    t0 = time.monotonic()
    proc.stdin.close()  # the controller went away
    assert proc.wait(timeout=5) == 128 + signal.SIGTERM
    assert time.monotonic() - t0 < 2
    assert _status(proc.stderr.read()).stopped_by == "SIGTERM"
    assert_no_job_process(tag)


def test_agent_stops_on_sigterm():
    tag = new_tag()
    proc = _agent_proc(_node(2, "print=ready", "hang"), tag)
    for _ in range(2):
        proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=5) == 143
    assert_no_job_process(tag)


def test_in_process_spawn_failure_is_a_launch_error():
    agent = Agent(_node(2, argv0=("/nonexistent/program",)))
    with pytest.raises(LaunchError, match="hostA: cannot start /nonexistent/program"):
        agent.start()


def test_in_process_success_and_pids():
    agent = Agent(_node(3, "sleep=0.1"))
    agent.start()
    assert len(agent.pids) == 3
    assert agent.wait(timeout=10) == NodeResult(3, "hostA", 0)


def test_each_worker_leads_its_own_session_and_autogroup():
    """A session, not just a group: under autogroup, workers sharing a session share one CPU share."""
    read_fd, write_fd = os.pipe()
    agent = Agent(_node(2, "ids"), stdout_fd=write_fd)
    agent.start()
    assert agent.wait(timeout=10) == NodeResult(3, "hostA", 0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        ids = [json.loads(line.split(" ", 1)[1]) for line in f.read().splitlines()]
    assert len(ids) == 2
    for w in ids:
        assert w["sid"] == w["pgid"] == w["pid"], w
    assert os.getsid(0) not in {w["sid"] for w in ids}
    if _autogroups_enabled():
        assert len({w["autogroup"] for w in ids}) == 2, ids


def _autogroups_enabled() -> bool:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip() == "1"
    except OSError:
        return False


def test_agent_process_reports_a_failure_at_once_and_its_status_at_exit():
    """The failure line comes as the worker fails, a grace period before the node has stopped."""
    tag, grace = new_tag(), 1.0
    proc = _agent_proc(_node(2, "ignore_term", "r11:sleep=0.2", "r11:exit=9", "hang", grace=grace), tag)
    lines = []
    while (failure := parse_failure_line(line := proc.stderr.readline())) is None:
        assert line, f"no failure line before EOF: {lines}"
        lines.append(line)
    reported = time.monotonic()
    assert proc.wait(timeout=10) == 9
    assert time.monotonic() - reported > 0.8 * grace  # the SIGTERM-ignoring rank 10 was still stopping
    assert failure == _status(proc.stderr.read())
    assert failure.failed_at is not None and abs(failure.failed_at - time.time()) < 60
    assert replace(failure, failed_at=None) == NodeResult(3, "hostA", 9, rank=11, cause="exit")
    proc.stdin.close()
    assert_no_job_process(tag)


# -- files in shared directories: --save_pid and --enable_each_rank_log ---------------------------

def _victim(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    return victim


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "file", "dangling"])
def test_an_existing_pid_file_is_never_followed_or_reused(tmp_path, plant):
    victim, pid_file = _victim(tmp_path), tmp_path / "123.deepspeed"
    if plant == "symlink":
        pid_file.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, pid_file)
    elif plant == "file":
        pid_file.write_text("999\n")
    else:
        pid_file.symlink_to(tmp_path / "created-through-the-link")
    agent = Agent(_node(1, "print=started", pid_file=str(pid_file)))
    with pytest.raises(LaunchError) as info:
        agent.start()
    assert str(info.value) == (f"hostA: --save_pid: {pid_file} already exists (left by an earlier job, or put "
                               "there by someone else); dslaunch neither follows nor reuses it: check and remove it")
    assert victim.read_text() == "precious\n" and not agent.pids  # nothing written, nothing started
    assert not (tmp_path / "created-through-the-link").exists()
    assert os.path.lexists(pid_file)  # not ours: left for the user to check


@pytest.mark.parametrize("actions, code", [(("sleep=0.1",), 0), (("exit=3",), 3)])
def test_pid_file_is_private_and_gone_after_the_job(tmp_path, actions, code):
    pid_file = tmp_path / "123.deepspeed"
    agent = Agent(_node(2, *actions, pid_file=str(pid_file)))
    agent.start()
    assert int(pid_file.read_text()) == os.getpid() and pid_file.stat().st_mode & 0o777 == 0o600
    assert agent.wait(timeout=10).exit_code == code
    assert not pid_file.exists()


def test_pid_file_is_removed_when_the_agent_is_sigkilled(tmp_path):
    tag, pid_file = new_tag(), tmp_path / "123.deepspeed"
    proc = _agent_proc(_node(1, "print=ready", "hang", pid_file=str(pid_file)), tag)
    proc.stdout.readline()
    assert int(pid_file.read_text()) == proc.pid
    proc.kill()
    proc.wait(timeout=5)
    deadline = time.monotonic() + 2
    while pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_file.exists()  # the watchdog removed it
    assert_no_job_process(tag)


def test_a_pid_file_someone_replaced_is_not_removed(tmp_path):
    pid_file = tmp_path / "123.deepspeed"
    agent = Agent(_node(1, "sleep=0.3", pid_file=str(pid_file)))
    agent.start()
    pid_file.rename(tmp_path / "moved")  # keeps our file (and its inode number) alive
    pid_file.write_text("someone else's\n")
    agent.wait(timeout=10)
    assert pid_file.read_text() == "someone else's\n"


@pytest.mark.parametrize("plant", ["symlink", "hardlink", "fifo"])
@pytest.mark.timeout(15)  # a FIFO opened for writing would block
def test_rank_logs_replace_what_is_there_without_writing_through_it(tmp_path, plant):
    victim, logs = _victim(tmp_path), tmp_path / "logs"
    logs.mkdir()
    planted = logs / "rank10.log"
    if plant == "symlink":
        planted.symlink_to(victim)
    elif plant == "hardlink":
        os.link(victim, planted)
    else:
        os.mkfifo(planted)
    read_fd, write_fd = os.pipe()
    agent = Agent(_node(2, "print=out{rank}", log_dir=str(logs)), stdout_fd=write_fd)
    agent.start()
    assert agent.wait(timeout=10).exit_code == 0
    os.close(write_fd)
    os.close(read_fd)
    assert victim.read_text() == "precious\n" and victim.stat().st_nlink == 1
    assert not planted.is_symlink() and planted.read_text() == "out10\n"
    assert (logs / "rank11.log").read_text() == "out11\n"


def test_rank_logs_and_their_new_directory_are_private(tmp_path):
    """A rank's output may hold tokens or data paths: its log is the user's alone, as the job's
    other files are (DeepSpeed leaves them to the umask, usually readable by everyone)."""
    logs = tmp_path / "new" / "logs"
    agent = Agent(_node(2, "print=out{rank}", log_dir=str(logs)))
    agent.start()
    assert agent.wait(timeout=10).exit_code == 0
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700
    assert {stat.S_IMODE((logs / f"rank1{r}.log").stat().st_mode) for r in (0, 1)} == {0o600}


def test_a_rank_log_that_cannot_be_created_is_a_launch_error_before_any_worker(tmp_path):
    logs = tmp_path / "logs"
    (logs / "rank11.log").mkdir(parents=True)
    pid_file = tmp_path / "123.deepspeed"
    agent = Agent(_node(2, "print=x", log_dir=str(logs), pid_file=str(pid_file)))
    with pytest.raises(LaunchError, match=f"hostA: {logs}/rank11.log: Is a directory"):
        agent.start()
    assert not agent.pids and not pid_file.exists()
