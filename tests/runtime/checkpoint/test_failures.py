"""A save that fails at each step removes what it created and says truthfully what is on disk;
the next save removes what killed saves left behind, and only that."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint import format as checkpoint_format
from dslaunch.runtime.checkpoint import leftovers as checkpoint_leftovers
from dslaunch.runtime.checkpoint import publish as checkpoint_publish
from dslaunch.runtime.checkpoint.store import LATEST, MANIFEST, CheckpointStore, write_atomic
from dslaunch.runtime.checkpoint.writer import LocalComm, TagWrite, write_tag
from tests.runtime.checkpoint.helpers import verify

pytestmark = pytest.mark.timeout(60)


def _save(store: CheckpointStore, step: int, tag: str | None = None, comm=None, keep_last: int = 0,
          leader: bool = True) -> None:
    files = {"model.bin": {"w": torch.full((1000,), float(step))}, "extra.bin": {"step": step}}
    write_tag(comm or LocalComm(), TagWrite(store, tag or f"global_step{step}", files, {"step": step},
                                            leader=leader, keep_last=keep_last))


def _step(store: CheckpointStore, tag: str) -> int:
    return store.read(tag, "extra.bin", verify(store, tag))["step"]


def _snapshot(root: Path) -> dict[str, object]:
    """Every entry of ``root`` with its content (files) or manifest (tags)."""
    out: dict[str, object] = {}
    for entry in sorted(root.iterdir()):
        out[entry.name] = (entry / MANIFEST).read_text() if entry.is_dir() else entry.read_bytes()
    return out


def _enospc(path: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def _at(name: str, fd: int | None) -> Path:
    """Where a call given ``name`` relative to the directory descriptor ``fd`` (safe_write's way) acts."""
    return Path(os.readlink(f"/proc/self/fd/{fd}")) / name if fd is not None else Path(name)


def _fail_mkdir_of_tmp(mp: pytest.MonkeyPatch) -> None:
    real = os.mkdir
    mp.setattr(os, "mkdir", lambda path, *a, **k: _enospc(_at(path, k.get("dir_fd")))
               if Path(path).name.startswith(".tmp-") else real(path, *a, **k))


def _fail_owner_record(mp: pytest.MonkeyPatch) -> None:
    real = os.replace  # the record is written whole, then renamed into place: that fails

    def replace(a, b, **k):
        if Path(b).name.startswith(".owner-"):
            _enospc(_at(b, k.get("dst_dir_fd")))
        return real(a, b, **k)

    mp.setattr(os, "replace", replace)


def _fail_second_file(mp: pytest.MonkeyPatch) -> None:
    real, calls = checkpoint_format.write_object, []

    def write_object(path, obj, durable=True, reuse=None):
        calls.append(path)
        if len(calls) == 2:  # after one complete file and part of the next
            Path(path).write_bytes(b"partial")
            _enospc(path)
        return real(path, obj, durable, reuse)

    mp.setattr(checkpoint_format, "write_object", write_object)


def _fail_manifest(mp: pytest.MonkeyPatch) -> None:
    real = checkpoint_publish.write_file
    mp.setattr(checkpoint_publish, "write_file", lambda where, name, *a, **k: _enospc(Path(where) / name)
               if name == MANIFEST else real(where, name, *a, **k))


def _fail_rename_into_place(mp: pytest.MonkeyPatch) -> None:
    real = os.rename
    mp.setattr(os, "rename", lambda a, b: _enospc(b) if Path(a).name.startswith(".tmp-") else real(a, b))


def _fail_exchange(mp: pytest.MonkeyPatch) -> None:
    def exchange(a: Path, b: Path) -> bool:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(b))

    mp.setattr(checkpoint_publish, "_exchange", exchange)


def _fail_latest(mp: pytest.MonkeyPatch) -> None:
    real = os.replace
    mp.setattr(os, "replace", lambda a, b, **k: _enospc(_at(b, k.get("dst_dir_fd"))) if Path(b).name == LATEST
               else real(a, b, **k))


def _fail_fsync_after_latest(mp: pytest.MonkeyPatch) -> None:
    """``latest`` is replaced, then fsyncing its directory fails: it must be put back."""
    real_replace, real_fsync, replaced = os.replace, os.fsync, []
    mp.setattr(os, "replace", lambda a, b, **k: (replaced.append(Path(b).name), real_replace(a, b, **k))[1])

    def fsync(fd: int) -> None:
        if replaced[-1:] == [LATEST] and "failed once" not in replaced:  # the next fsync: the directory's
            replaced.append("failed once")
            raise OSError(errno.EIO, os.strerror(errno.EIO), os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    mp.setattr(os, "fsync", fsync)


FAILURES = [
    (_fail_mkdir_of_tmp, "creating .*\\.tmp-"),
    (_fail_owner_record, "creating .*\\.tmp-"),
    (_fail_second_file, "writing files"),
    (_fail_manifest, "publishing it"),
    (_fail_rename_into_place, "publishing it"),
    (_fail_exchange, "publishing it"),
    (_fail_latest, "publishing it"),
    (_fail_fsync_after_latest, "publishing it"),
]


CASES = [pytest.param(fail, step, overwrite, no_exchange,
                      id=f"{fail.__name__[1:]}-{'same-tag' if overwrite else 'new-tag'}"
                         f"{'-no-renameat2' if no_exchange else ''}")
         for fail, step in FAILURES for overwrite in (False, True) for no_exchange in (False, True)
         if fail is not _fail_exchange or (overwrite and not no_exchange)]  # only a tag that exists is exchanged


@pytest.mark.parametrize("fail,step,overwrite,no_exchange", CASES)
def test_a_failed_save_leaves_the_directory_as_it_was(tmp_path: Path, monkeypatch, fail, step: str,
                                                      overwrite: bool, no_exchange: bool) -> None:
    if no_exchange:  # a file system without renameat2 (NFS): the tag is replaced in two renames
        monkeypatch.setattr(checkpoint_publish, "_exchange", lambda a, b: False)
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    _save(store, 2, tag="last")
    before = _snapshot(tmp_path)
    tag = "last" if overwrite else "global_step3"
    with monkeypatch.context() as mp:
        fail(mp)
        with pytest.raises(CheckpointError) as err:
            _save(store, 3, tag=tag)
    message = str(err.value)
    assert f"checkpoint save of tag {tag!r} failed while" in message
    assert f"rank 0: OSError: [Errno {errno.ENOSPC}]" in message or "[Errno 5]" in message
    assert _snapshot(tmp_path) == before, message  # nothing left over, nothing older touched
    assert f"{tmp_path / LATEST} still names 'last'" in message
    if overwrite:
        assert "tag 'last' is unchanged." in message and _step(store, "last") == 2
    else:
        assert "no tag 'global_step3' was published." in message
    assert "\n" not in message and len(message) < 1000
    assert re.search(f"failed while {step}", message), message
    _save(store, 4, tag=tag)  # the next save works and leaves nothing behind either
    assert set(_snapshot(tmp_path)) == set(before) | {tag}


def test_a_failed_rollback_is_reported_as_it_is(tmp_path: Path, monkeypatch) -> None:
    """``latest`` was replaced and cannot be put back: the new tag stays, and the message says so."""
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    _fail_fsync_after_latest(monkeypatch)
    real = write_atomic

    def no_restore(path, write, durable=True, tmp=None):
        if path.name == LATEST and (tmp_path / LATEST).read_text() == "global_step2":
            _enospc(path)
        real(path, write, durable, tmp)

    monkeypatch.setattr(checkpoint_publish, "write_atomic", no_restore)
    with pytest.raises(CheckpointError) as err:
        _save(store, 2)
    assert str(err.value).endswith(f"On disk: {tmp_path / LATEST} names 'global_step2', tag "
                                   "'global_step2' is complete (the new version).")
    assert (tmp_path / LATEST).read_text() == "global_step2" and _step(store, "global_step2") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", LATEST]


def test_a_previous_version_that_cannot_be_put_back_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(checkpoint_publish, "_exchange", lambda a, b: False)
    store = CheckpointStore(tmp_path)
    _save(store, 1, tag="last")
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: _enospc(b) if Path(b).name == "last" else real(a, b))
    with pytest.raises(CheckpointError) as err:
        _save(store, 2, tag="last")
    old = tmp_path / ".old-last"
    assert str(err.value).endswith(f"tag 'last' is missing: its previous version is in {old} (the next "
                                   "save moves it back).")
    monkeypatch.undo()
    _save(store, 3, tag="other")  # the next save moves it back before anything else
    assert _step(store, "last") == 1 and not old.exists()


def test_retention_failure_keeps_the_saved_tag(tmp_path: Path, monkeypatch, caplog) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    real = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: _enospc(b) if Path(b).name.startswith(".trash-")
                        else real(a, b))
    with caplog.at_level(logging.WARNING, "dslaunch.checkpoint"):
        _save(store, 2, keep_last=1)
    assert "tag 'global_step2' is saved and complete, but deleting older tags (keep_last=1) failed" in caplog.text
    assert (tmp_path / LATEST).read_text() == "global_step2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step1", "global_step2", LATEST]


class _ThreadComm:
    """Ranks as threads of one process (the collectives the protocol needs, nothing else)."""

    def __init__(self, rank: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self._slots, self._barrier = rank, len(slots), slots, barrier

    def all_gather_object(self, obj):
        self._slots[self.rank] = obj
        self._barrier.wait()
        out = list(self._slots)
        self._barrier.wait()
        return out


def test_node_local_leaders_all_roll_back_when_one_fails(tmp_path: Path, monkeypatch) -> None:
    """With node-local storage each node's leader publishes on its own disk: one that fails
    makes the others undo theirs, so no node ends up with a tag the others lack."""
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for d in disks:
        _save(CheckpointStore(d), 1)
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b, **k: _enospc(disks[1] / LATEST)
                        if _at(b, k.get("dst_dir_fd")) == disks[1] / LATEST else real(a, b, **k))
    slots, barrier, errors = [None, None], threading.Barrier(2), [None, None]

    def rank(r: int) -> None:
        try:
            _save(CheckpointStore(disks[r]), 2, comm=_ThreadComm(r, slots, barrier))
        except CheckpointError as exc:
            errors[r] = str(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert errors[0] == errors[1] and "failed while publishing it: rank 1: OSError" in errors[0]
    assert errors[0].endswith("On disk: " + "; ".join(
        f"rank {r}: {d / LATEST} still names 'global_step1', no tag 'global_step2' was published"
        for r, d in enumerate(disks)) + "."), errors[0]
    for d in disks:
        assert sorted(p.name for p in d.iterdir()) == ["global_step1", LATEST]
        assert (d / LATEST).read_text() == "global_step1"


class _DyingComm(LocalComm):
    """A world where a peer dies at the n-th collective (gloo raises on the survivors)."""

    def __init__(self, n: int) -> None:
        self.calls, self.n = 0, n

    def all_gather_object(self, obj):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("Connection closed by peer")
        return [obj]


@pytest.mark.parametrize("n,published", [(1, False), (2, False), (3, True)])
def test_a_dead_peer_leaves_nothing_half_done(tmp_path: Path, n: int, published: bool) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    with pytest.raises(RuntimeError, match="closed by peer"):
        _save(store, 2, comm=_DyingComm(n))
    expected = ["global_step1", LATEST] + (["global_step2"] if published else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(expected)
    assert (tmp_path / LATEST).read_text() == ("global_step2" if published else "global_step1")


# ---- leftovers of killed saves ----------------------------------------------------------------
def _owner(root: Path, tag: str, host: str, pid: int, start: float) -> None:
    (root / f".owner-{tag}").write_text(json.dumps({"host": host, "pid": pid, "start": start}))


def _leftover(root: Path, tag: str) -> list[str]:
    tmp = root / f".tmp-{tag}"
    tmp.mkdir()
    (tmp / "model.bin").write_bytes(b"x" * 100)
    (root / f".latest.tmp-{tag}").write_text(tag)
    return [tmp.name, f".latest.tmp-{tag}", f".owner-{tag}"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_next_save_removes_leftovers_of_dead_saves_only(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    host, me = socket.gethostname(), psutil.Process()
    stale = _leftover(tmp_path, "dead")
    _owner(tmp_path, "dead", host, _dead_pid(), 0.0)
    stale += _leftover(tmp_path, "reused_pid")  # the pid is alive again, but another process
    _owner(tmp_path, "reused_pid", host, me.pid, me.create_time() - 100)
    stale += _leftover(tmp_path, "old_version")[:2]  # dslaunch before owner records
    stale += [".trash-1234", ".latest.tmp999"]
    (tmp_path / ".trash-1234").mkdir()
    (tmp_path / ".latest.tmp999").write_text("global_step9")
    unknown = _leftover(tmp_path, "elsewhere")  # another host: it may be alive
    _owner(tmp_path, "elsewhere", "other-host", 1, 0.0)
    unknown += _leftover(tmp_path, "torn")  # killed while writing its owner record
    (tmp_path / ".owner-torn").write_text('{"ho')
    (tmp_path / "notes").mkdir()
    (tmp_path / ".notes").write_text("mine")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = _leftover(tmp_path, "live")
        _owner(tmp_path, "live", host, sleeper.pid, psutil.Process(sleeper.pid).create_time())
        assert store.candidates()[0] == ["global_step1"]  # leftovers are never loaded
        _save(store, 2)
        mine = {"notes", ".notes", "global_step1", "global_step2", LATEST}
        assert {p.name for p in tmp_path.iterdir()} == mine | set(live) | set(unknown)
        # An unknown owner is given up once nothing in its files changed for longer than the
        # collectives' timeout: a save that is alive writes more often.
        now = checkpoint_leftovers.time.time()
        monkeypatch.setattr(checkpoint_leftovers.time, "time", lambda: now + checkpoint_leftovers.SAVE_TIMEOUT_S + 10)
        _save(store, 3)
        monkeypatch.undo()
        assert {p.name for p in tmp_path.iterdir()} == mine | set(live) | {"global_step3"}
    finally:
        sleeper.kill()
        sleeper.wait()
    _save(store, 4)  # its owner is dead now
    assert not any(p.name.startswith(".") and p.name != ".notes" for p in tmp_path.iterdir())


def test_an_unknown_owner_that_is_recent_is_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    left = _leftover(tmp_path, "torn")
    (tmp_path / ".owner-torn").write_text('{"ho')  # killed while writing its owner record
    _save(store, 1)
    assert set(left) <= {p.name for p in tmp_path.iterdir()}


def test_the_same_tag_in_progress_in_a_live_process_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    _save(store, 1)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        left = _leftover(tmp_path, "global_step2")
        _owner(tmp_path, "global_step2", socket.gethostname(), sleeper.pid,
               psutil.Process(sleeper.pid).create_time())
        with pytest.raises(CheckpointError) as err:
            _save(store, 2)
        assert f"{tmp_path / '.owner-global_step2'}: another save of tag 'global_step2' is in " \
               f"progress here (process {sleeper.pid} on {socket.gethostname()})" in str(err.value)
        assert "latest names 'global_step1'" in str(err.value)
        assert set(left) <= {p.name for p in tmp_path.iterdir()}  # its files are untouched
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_previous_version_left_aside_is_moved_back_or_removed(tmp_path: Path) -> None:
    """A save killed between its two renames (no renameat2) leaves ``.old-<tag>``: moved back
    when the tag is missing, removed when the tag was replaced."""
    store = CheckpointStore(tmp_path)
    _save(store, 1, tag="a")
    _save(store, 2, tag="b")
    (tmp_path / "a").rename(tmp_path / ".old-a")  # killed after the first rename
    shutil.copytree(tmp_path / "b", tmp_path / ".old-b")  # killed before removing it
    _save(store, 3)
    assert _step(store, "a") == 1 and _step(store, "b") == 2
    assert not (tmp_path / ".old-a").exists() and not (tmp_path / ".old-b").exists()
    assert (tmp_path / LATEST).read_text() == "global_step3"


def test_write_atomic_removes_its_temp_file_on_failure(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    path.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        _enospc(tmp)

    with pytest.raises(OSError):
        write_atomic(path, fail)
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"] and path.read_text() == "old"
