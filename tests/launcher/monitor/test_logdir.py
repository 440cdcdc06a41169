"""The log directory against a hostile local user: planted directories, links and loose
permissions are refused with one line, never followed; the logs are private (0700/0600).

The other user is uid 65534 (nobody): the tests create files and links owned by it, so they
need root; a run as another user skips them.
"""

from __future__ import annotations

import os
import re
import stat

import pytest

from dslaunch.errors import LaunchError
from dslaunch.launcher.monitor.events import EVENTS_FILE, EventLog
from tests.launcher.helpers import FAKE, run_dslaunch

OTHER_UID = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="creates files owned by another user")
pytestmark = pytest.mark.timeout(60)


def _victim(tmp_path) -> str:
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    return str(victim)


@as_root
def test_a_planted_job_directory_is_refused_and_its_links_not_followed(tmp_path):
    base, victim = tmp_path / "logs", _victim(tmp_path)
    (base / "job").mkdir(parents=True)
    os.symlink(victim, base / "job" / EVENTS_FILE)
    os.lchown(base / "job" / EVENTS_FILE, OTHER_UID, OTHER_UID)
    os.chown(base / "job", OTHER_UID, OTHER_UID)
    with pytest.raises(LaunchError, match=r"^--log_dir /.*/logs: the job directory 'job' is already there"):
        EventLog(str(base / "job"))
    assert open(victim).read() == "root's file\n"


@as_root
@pytest.mark.parametrize("owner, mode, problem", [
    (OTHER_UID, 0o755, "owned by another user (uid 65534)"),
    (0, 0o777, "writable by every user and not sticky"),
])
def test_a_base_others_control_is_refused(tmp_path, owner, mode, problem):
    base = tmp_path / "logs"
    base.mkdir()
    os.chown(base, owner, owner)
    os.chmod(base, mode)
    with pytest.raises(LaunchError, match=re.escape(problem)):
        EventLog(str(base / "job"))
    assert os.listdir(base) == []


@as_root
def test_a_sticky_shared_base_like_tmp_is_fine(tmp_path):
    base = tmp_path / "shared"
    base.mkdir()
    os.chmod(base, 0o1777)
    log = EventLog(str(base / "job"))
    log.emit("note", text="hi")
    log.close()
    assert "note" in (base / "job" / EVENTS_FILE).read_text()


@as_root
def test_a_planted_log_dir_link_does_not_move_the_logs(tmp_path):
    """The default log dir planted as a link by another user: the job refuses to start, one line,
    and nothing lands where the link points."""
    elsewhere = tmp_path / "root_owned"
    elsewhere.mkdir()
    default = tmp_path / "state" / "dslaunch" / "logs"
    default.parent.mkdir(parents=True)
    os.symlink(elsewhere, default)
    os.lchown(default, OTHER_UID, OTHER_UID)
    r = run_dslaunch(["--num_gpus", "1", FAKE, "print=ran"], XDG_STATE_HOME=str(tmp_path / "state"))
    assert r.returncode == 1, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"dslaunch: error: --log_dir {default}: a symbolic link owned by another user (uid 65534)")
    assert "Traceback" not in r.stderr and "ran" not in r.stdout
    assert os.listdir(elsewhere) == []


def test_a_link_of_ones_own_is_followed(tmp_path):
    real = tmp_path / "scratch"
    real.mkdir()
    os.symlink(real, tmp_path / "logs")
    EventLog(str(tmp_path / "logs" / "job")).close()
    assert os.listdir(real) == ["job"]


def test_the_logs_are_private_and_rewritten_files_replace_links(tmp_path):
    os.umask(old := os.umask(0))  # the most permissive umask: the modes are the log's own
    try:
        log = EventLog(str(tmp_path / "logs" / "job"))
        job = tmp_path / "logs" / "job"
        victim = _victim(tmp_path)
        os.symlink(victim, job / "error-rank1.json")  # as if planted: a rewrite replaces the link
        assert log.write_file("error-rank1.json", "{}\n") == str(job / "error-rank1.json")
        log.close()
    finally:
        os.umask(old)
    assert open(victim).read() == "root's file\n"
    assert (job / "error-rank1.json").read_text() == "{}\n"
    assert stat.S_IMODE(os.stat(tmp_path / "logs").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(job).st_mode) == 0o700
    for name in (EVENTS_FILE, "error-rank1.json"):
        assert stat.S_IMODE(os.lstat(job / name).st_mode) == 0o600, name
    assert sorted(os.listdir(job)) == ["error-rank1.json", EVENTS_FILE]  # no temporary file left


def test_a_long_log_dir_is_shortened_in_the_error(tmp_path):
    r = run_dslaunch(["--num_gpus", "1", "--log_dir", str(tmp_path / ("x" * 4300)), FAKE])
    line = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 1 and line.startswith("dslaunch: error: --log_dir "), r.stderr
    assert "File name too long" in line and len(line) < 500, line
