"""``dslaunch.safe_write`` against a hostile local user: planted links, FIFOs, hard links and
directories another user owns or everyone may write; what it creates and how it replaces."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from dslaunch import safe_write as sw
from tests.hostile import Victim, as_root, give, other_uid

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def victim(tmp_path):
    return Victim(tmp_path)


def test_directories_made_are_this_users_with_safe_modes_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        sw.make_dirs(tmp_path / "a" / "b")
        os.close(sw.open_dir(tmp_path / "p" / "q", mode=0o700))
    finally:
        os.umask(old)
    for path, mode in ((tmp_path / "a", 0o755), (tmp_path / "a" / "b", 0o755), (tmp_path / "p" / "q", 0o700)):
        st = os.stat(path)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), mode), path


@as_root
def test_a_directory_another_user_owns_or_everyone_may_write_is_refused_in_one_line(tmp_path):
    theirs, open_to_all, sticky = tmp_path / "theirs", tmp_path / "all", tmp_path / "sticky"
    for d in (theirs, open_to_all, sticky):
        d.mkdir()
    give(theirs, other_uid())
    os.chmod(open_to_all, 0o777)
    os.chmod(sticky, 0o1777)
    with pytest.raises(sw.UnsafePath) as err:
        sw.write_file(theirs, "x", b"1")
    assert str(err.value) == (f"{theirs}: directory owned by another user (uid {other_uid()}); dslaunch writes "
                              "only into directories of this user's (or root's): give one you own")
    with pytest.raises(sw.UnsafePath, match=r"/all: directory writable by every user and not sticky"):
        sw.make_dirs(open_to_all / "below")  # made there, another user could swap it later
    with pytest.raises(sw.UnsafePath, match="owned by another user"):
        sw.make_dirs(theirs / "sub")  # created inside another user's directory: refused before
    assert os.listdir(theirs) == [] and os.listdir(open_to_all) == []
    sw.write_file(sticky, "x", b"1")  # /tmp's kind of directory is fine
    assert (sticky / "x").read_bytes() == b"1"


@as_root
def test_a_link_on_the_way_is_followed_only_when_this_user_owns_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "mine")
    os.symlink(real, tmp_path / "theirs")
    give(tmp_path / "theirs", other_uid())
    sw.write_file(tmp_path / "mine" / "sub", "f", "via my link")
    assert (real / "sub" / "f").read_text() == "via my link"
    with pytest.raises(sw.UnsafePath, match=rf"^{tmp_path}/theirs: a symbolic link owned by another user"):
        sw.make_dirs(tmp_path / "theirs" / "new")
    assert not (real / "new").exists()


def test_a_replaced_file_replaces_a_planted_link_and_never_writes_through_it(tmp_path, victim):
    victim.plant(tmp_path / "out.json")
    sw.write_file(tmp_path, "out.json", "{}")
    assert victim.untouched()
    assert not os.path.islink(tmp_path / "out.json") and (tmp_path / "out.json").read_text() == "{}"
    assert sorted(os.listdir(tmp_path)) == ["out.json", "root-only"]  # no temporary file left


def test_temporary_names_are_unpredictable_so_a_planted_tmp_link_is_never_used(tmp_path, victim):
    for name in ("out.tmp", ".out.tmp", "out.json.tmp"):
        victim.plant(tmp_path / name)
    sw.write_file(tmp_path, "out", b"new")
    with sw.atomic_path(tmp_path / "model.pt") as fresh:
        assert fresh.parent == tmp_path and fresh.name.startswith(".model.pt.") and fresh.stat().st_size == 0
        fresh.write_bytes(b"weights")
    assert victim.untouched() and (tmp_path / "model.pt").read_bytes() == b"weights"


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(tmp_path):
    (tmp_path / "f").write_text("old")
    with pytest.raises(RuntimeError), sw.atomic_file(tmp_path, "f") as f:
        f.write(b"half")
        raise RuntimeError("disk full")
    assert os.listdir(tmp_path) == ["f"] and (tmp_path / "f").read_text() == "old"


def test_new_files_are_created_exclusively(tmp_path, victim):
    victim.plant(tmp_path / "pid")
    with pytest.raises(FileExistsError):
        sw.write_new(tmp_path / "pid", b"1")
    with pytest.raises(FileExistsError):
        sw.write_file(tmp_path, "pid", b"1", replace=False)
    assert victim.untouched()
    ident = sw.write_new(tmp_path / "own", b"1")
    sw.remove_own(tmp_path / "own", ident)
    assert not (tmp_path / "own").exists()


def test_appending_refuses_a_link_a_fifo_and_a_hard_link(tmp_path, victim):
    victim.plant(tmp_path / "link.csv")
    os.mkfifo(tmp_path / "fifo.csv")
    os.link(victim.path, tmp_path / "hard.csv")
    for name, why in (("link.csv", "a symbolic link or FIFO is there"), ("fifo.csv", "a symbolic link or FIFO"),
                      ("hard.csv", r"with 2 link\(s\)")):
        done = threading.Event()

        def attempt(name=name, why=why, done=done):
            with pytest.raises(sw.UnsafePath, match=why):
                sw.append_file(tmp_path, name)
            done.set()

        t = threading.Thread(target=attempt, daemon=True)
        t.start()
        t.join(5)
        assert done.is_set(), f"{name}: the append hung or did not refuse"
    assert victim.untouched()
    with sw.append_file(tmp_path, "fine.csv") as f:
        f.write("a\n")
    with sw.append_file(tmp_path, "fine.csv") as f:
        f.write("b\n")
    assert (tmp_path / "fine.csv").read_text() == "a\nb\n"


def test_a_lock_file_is_shared_but_never_opened_through_a_link_a_fifo_or_a_hard_link(tmp_path, victim):
    victim.plant(tmp_path / "link.lock")
    os.mkfifo(tmp_path / "fifo.lock")
    os.link(victim.path, tmp_path / "hard.lock")
    for name in ("link.lock", "fifo.lock", "hard.lock"):
        with pytest.raises(sw.UnsafePath, match=name):
            sw.lock_file(tmp_path, name)
    assert victim.untouched()
    first, second = sw.lock_file(tmp_path, "build.lock"), sw.lock_file(tmp_path, "build.lock")
    try:  # the same file for every process that locks it, private to this user
        assert os.fstat(first).st_ino == os.fstat(second).st_ino
        assert stat.S_IMODE(os.fstat(first).st_mode) == 0o600
    finally:
        os.close(first)
        os.close(second)



def test_a_taken_over_file_keeps_its_pages_but_never_a_link_or_a_shared_inode(tmp_path, victim):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir(), new.mkdir()
    (old / "shard").write_bytes(b"x" * 100)
    inode = os.stat(old / "shard").st_ino
    fd = sw.take_over(new, "shard", old, "shard")
    try:  # the same file (its pages), under the new name only, to overwrite in place
        assert os.fstat(fd).st_ino == inode and not (old / "shard").exists()
        os.write(fd, b"y")
    finally:
        os.close(fd)
    assert (new / "shard").read_bytes() == b"y" + b"x" * 99
    with pytest.raises(FileExistsError):  # a name already there is never replaced
        sw.take_over(new, "shard", new, "shard")
    victim.plant(old / "link")
    os.link(victim.path, old / "hard")
    for name in ("link", "hard"):  # refused, and nothing left at the new name
        with pytest.raises(sw.UnsafePath):
            sw.take_over(new, name, old, name)
        assert not (new / name).exists()
    assert victim.untouched()

@as_root
def test_appending_refuses_another_users_file(tmp_path):
    (tmp_path / "theirs.log").write_text("")
    give(tmp_path / "theirs.log", other_uid())
    with pytest.raises(sw.UnsafePath, match=rf"theirs.log: owned by uid {other_uid()} with 1 link"):
        sw.append_file(tmp_path, "theirs.log")


def test_explain_is_one_line_naming_the_file(tmp_path):
    try:
        sw.append_file(tmp_path / "missing" / "x", "y") if False else os.open("nope", os.O_RDONLY)
    except OSError as err:
        assert sw.explain(err, tmp_path / "f") == f"{tmp_path}/f: No such file or directory"
    with pytest.raises(IsADirectoryError):
        sw.split_path("out/")
