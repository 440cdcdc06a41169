"""The job loop with real processes: restarts after a killed rank, stops on a repeated bug, on the
user's word and when the budget is spent (fake workers, no torch)."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest

from tests.launcher.helpers import (
    DSLAUNCH,
    FAKE,
    assert_no_job_process,
    new_tag,
    own_network,
    run_dslaunch,
    start_dslaunch,
    tagged_env,
    wait_for_lines,
)

pytestmark = pytest.mark.timeout(60)


def _ports(stdout: str) -> list[str]:
    return re.findall(r"MASTER_PORT=(\d+)", stdout)


def test_a_killed_rank_is_restarted_with_a_new_port_and_the_restart_count(free_port):
    r = run_dslaunch(["--num_gpus", "2", "--max_restarts", "2", "--master_port", str(free_port), FAKE,
                      "var=TORCHELASTIC_RESTART_COUNT", "var=DSLAUNCH_RESTART_COUNT", "var=MASTER_PORT",
                      "c0:r1:sleep=2", "c0:r1:signal=SIGKILL"], timeout=40)  # rank 0 prints first
    assert r.returncode == 0, r.stderr
    restarts = [line for line in r.stderr.splitlines() if "dslaunch: restart" in line and " in " in line]
    assert restarts == ["dslaunch: restart 1 of 2 in 1 s after signal: rank 1 on localhost was killed by "
                        "SIGKILL (exit code 137)"], r.stderr
    assert r.stdout.count("TORCHELASTIC_RESTART_COUNT=0") == 2 and r.stdout.count("DSLAUNCH_RESTART_COUNT=1") == 2
    # the user fixed the port: every run uses it
    assert set(_ports(r.stdout)) == {str(free_port)}


def test_restarts_pick_a_fresh_port_unless_one_was_given():
    # in a network of its own: the first run is on the default port, which may be busy on this machine
    r = subprocess.run([*own_network(), *DSLAUNCH, "--num_gpus", "1", "--max_restarts", "1", FAKE, "var=MASTER_PORT",
                        "c0:exit=3"], env=tagged_env(new_tag()), capture_output=True, text=True, timeout=40)
    assert r.returncode == 0, r.stderr
    first, second = _ports(r.stdout)
    assert first == "29500" and second != first


def test_the_same_exception_twice_is_the_scripts_bug_and_ends_the_restarts():
    tag = new_tag()
    r = run_dslaunch(["--num_gpus", "2", "--max_restarts", "5", FAKE, "sleep=0.2", "r0:raise=boom"], tag=tag,
                     timeout=40)
    assert r.returncode == 1, r.stderr
    assert r.stderr.count("dslaunch: restart 1 of 5") == 1 and "restart 2" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("dslaunch: error: rank 0 on localhost raised RuntimeError: boom")
    reason, details = last.split("; details: dslaunch status ")  # the monitor's pointer comes last
    assert reason.endswith("the same exception in two runs in a row: a bug in the script, not restarted"), last
    assert details
    assert_no_job_process(tag)


def test_the_same_exception_with_another_address_in_each_run_is_still_the_same_bug():
    r = run_dslaunch(["--num_gpus", "1", "--max_restarts", "5", FAKE, "raise=bad batch <Batch object at {addr}>"],
                     timeout=40)
    assert r.returncode == 1, r.stderr
    assert "restart 1 of 5" in r.stderr and "restart 2" not in r.stderr, r.stderr
    assert "the same exception in two runs in a row: a bug in the script" in r.stderr, r.stderr


def test_a_rank_that_exited_on_its_own_is_blamed_not_the_peer_that_lost_it_first():
    # Rank 0 dies first, of the peer loss rank 1's exit causes; rank 1 leaves with code 3 after it
    # (still tearing down when the agent stops it: it ignores SIGTERM here, so its code stays 3).
    r = run_dslaunch(["--num_gpus", "2", FAKE, "r1:ignore_term", "r0:sleep=0.2",
                      "r0:raise=[pair.cc:553] Connection closed by peer [127.0.0.1]:41234", "r1:sleep=1.0",
                      "r1:exit=3"], timeout=40)
    assert r.returncode == 3, r.stderr
    assert "error: rank 1 on localhost exited with code 3" in r.stderr, r.stderr


def test_a_spent_budget_exits_with_the_last_failures_code():
    r = run_dslaunch(["--num_gpus", "2", "--max_restarts", "2", FAKE, "r1:signal=SIGKILL", "r0:sleep=5"],
                     timeout=40)
    assert r.returncode == 137, r.stderr
    assert "restart 1 of 2 in 1 s" in r.stderr and "restart 2 of 2 in 2 s" in r.stderr
    reason, _ = r.stderr.strip().splitlines()[-1].split("; details: dslaunch status ")
    assert reason.endswith("stopped all other workers; restart budget spent (2 of 2)")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_from_the_user_is_never_restarted(sig):
    tag = new_tag()
    proc = start_dslaunch(["--num_gpus", "2", "--max_restarts", "3", FAKE, "print=ready", "hang"], tag)
    wait_for_lines(proc, 2, timeout=20)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 128 + sig, err
    assert "dslaunch: restart" not in err and f"stopped by {sig.name}" in err, err
    assert_no_job_process(tag)


def test_dry_run_shows_the_policy():
    r = run_dslaunch(["--dry-run", "--num_gpus", "2", "--max_restarts", "3", FAKE])
    assert r.returncode == 0, r.stderr
    assert "# restarts: up to 3, after 1 s doubling to at most 8 s; the same failure at the same step " \
           "twice stops the job" in r.stdout
    assert "TORCHELASTIC_RESTART_COUNT=0" in r.stdout and "TORCHELASTIC_MAX_RESTARTS=3" in r.stdout


@pytest.mark.parametrize("args, words", [
    (["--min_elastic_nodes", "2"], "--min_elastic_nodes 2 is only used with --elastic_training"),
    (["--elastic_training"], "--elastic_training restarts without a lost host, so it needs a restart budget"),
    (["--elastic_training", "--max_restarts", "1", "--min_elastic_nodes", "0"], "--min_elastic_nodes 0: expected"),
    (["--max_restarts", "-1"], "--max_restarts -1: expected 0 or more"),
    (["--resume_from", "ck"], "--resume_from ck acts when the job restarts: add --max_restarts N"),
])
def test_bad_restart_flags_are_one_line(args, words):
    r = run_dslaunch([*args, FAKE])
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and words in r.stderr, r.stderr


def _self_disabling_program(tmp_path):
    """A program whose first run takes its own exec permission away and fails: the restart then
    cannot start it (EACCES, also for root) until the test gives the permission back."""
    prog = tmp_path / "prog.sh"
    prog.write_text('#!/bin/sh\necho "run $DSLAUNCH_RESTART_COUNT"\n'
                    'if [ "$DSLAUNCH_RESTART_COUNT" = 0 ]; then chmod -x "$0"; exit 3; fi\n')
    prog.chmod(0o755)
    return prog


def test_a_restart_that_cannot_start_uses_one_restart_and_the_next_one_runs(tmp_path):
    prog = _self_disabling_program(tmp_path)
    proc = start_dslaunch(["--num_gpus", "1", "--max_restarts", "3", "--log_dir", str(tmp_path / "logs"),
                           "--no_python", str(prog)], new_tag())
    for line in proc.stderr:  # the second restart's line: the program may run again
        if line.startswith("dslaunch: restart 2 of 3 in 2 s after start: "):
            break
    else:
        raise AssertionError(f"no restart after the failed start; exit code {proc.wait()}")
    assert f"the run could not start: localhost: cannot start {prog}: Permission denied (exit code 1)" in line, line
    prog.chmod(0o755)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert out.splitlines() == ["[rank0] run 0", "[rank0] run 2"], out
    (log,) = (tmp_path / "logs").iterdir()
    runs = [e for e in map(json.loads, (log / "events.jsonl").read_text().splitlines()) if e["kind"] == "run_end"]
    assert [e["exit_code"] for e in runs] == [3, 1, 0] and "Permission denied" in runs[1]["error"], runs


def test_when_the_budget_is_spent_on_a_failed_start_the_job_exits_with_its_error(tmp_path):
    prog = _self_disabling_program(tmp_path)
    r = run_dslaunch(["--num_gpus", "1", "--max_restarts", "1", "--no_python", str(prog)], timeout=40)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines[-1] == f"dslaunch: error: localhost: cannot start {prog}: Permission denied", r.stderr
    assert lines[-2].startswith("dslaunch: restart 1 of 1 in 1 s after exit: rank 0 on localhost exited with code 3")
