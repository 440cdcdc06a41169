"""What killed saves leave in ``save_dir``, who owns it, and its removal.

A save of tag T (``publish.LeaderSave``) creates, besides T itself and ``latest``::

    .owner-T       host, pid and start time of the process saving T: written before anything
                   else of the save and removed after everything else
    .tmp-T/        the tag being written (only ever this save's own files)
    .old-T/        the tag's previous version, kept until the save commits
    .latest.tmp-T  ``latest`` being rewritten to name T

None of these is ever loaded (``CheckpointStore.tags`` skips them). What a killed save leaves is
removed by the next save's leader (``remove_stale``), and only when no live save can own it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.store import MANIFEST, CheckpointStore, Manifest

__all__ = ["SAVE_TIMEOUT_S", "Owner", "owner_file", "old_dir", "latest_tmp", "manifest_time", "remove",
           "remove_stale", "clear"]

# The timeout of the checkpoint collectives (writer.GroupComm). A live save touches its
# files more often: between two of its collectives it writes, and a collective that waits longer
# fails the save.
SAVE_TIMEOUT_S = 1800.0

def owner_file(store: CheckpointStore, tag: str) -> Path:
    return store.root / f".owner-{tag}"


def old_dir(store: CheckpointStore, tag: str) -> Path:
    return store.root / f".old-{tag}"


def latest_tmp(store: CheckpointStore, tag: str) -> Path:
    return store.root / f".latest.tmp-{tag}"


def manifest_time(tag_dir: Path) -> float | None:
    """The manifest time of a complete tag directory, else None."""
    try:
        return Manifest.from_json((tag_dir / MANIFEST).read_text(), tag_dir / MANIFEST).created
    except (OSError, UnicodeDecodeError, CheckpointError):
        return None


def remove(path: Path) -> None:
    """Delete a file or directory tree if it exists (best effort)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _process_start(pid: int) -> float | None:
    """When process ``pid`` on this host started, or None when there is none."""
    import psutil

    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


@dataclass(frozen=True)
class Owner:
    """The process saving a tag, as recorded in ``.owner-<tag>``."""

    host: str
    pid: int
    start: float

    @classmethod
    def me(cls) -> Owner:
        return cls(socket.gethostname(), os.getpid(), _process_start(os.getpid()) or 0.0)

    @classmethod
    def of(cls, store: CheckpointStore, tag: str) -> Owner | None:
        """The recorded owner of a save of ``tag``; None when there is no record."""
        try:
            body = json.loads(owner_file(store, tag).read_text())
            return cls(str(body["host"]), int(body["pid"]), float(body["start"]))
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            return cls("", -1, 0.0)  # torn by a crash while being written: owner unknown

    def alive(self) -> bool | None:
        """True/False on this host (a reused pid has another start time); None elsewhere."""
        if self.host != socket.gethostname():
            return None
        started = _process_start(self.pid)
        return started is not None and abs(started - self.start) < 1.0

    def to_json(self) -> str:
        return json.dumps({"host": self.host, "pid": self.pid, "start": self.start})


_LEFTOVERS = (".tmp-", ".old-", ".latest.tmp-", ".owner-")


def remove_stale(store: CheckpointStore) -> list[str]:
    """Leader, before a save: remove what killed or failed saves left in ``save_dir``.

    Leftovers of tag T (``.tmp-T``, ``.old-T``, ``.latest.tmp-T``, ``.owner-T``) go when
    ``_stale``; a ``.old-T`` whose tag T is missing (a save killed between its two renames) is
    moved back to T instead. ``.trash-*`` (a delete in progress) and ``.latest.tmp<pid>`` files of
    older dslaunch versions always go. Nothing else is touched.

    Returns:
        The names of the entries removed or moved back.
    """
    groups: dict[str, list[Path]] = {}
    done = []
    for entry in store.root.iterdir():
        prefix = next((p for p in _LEFTOVERS if entry.name.startswith(p)), None)
        if prefix is not None:
            groups.setdefault(entry.name.removeprefix(prefix), []).append(entry)
        elif entry.name.startswith((".trash-", ".latest.tmp")):
            remove(entry)
            done.append(entry.name)
    for tag, entries in groups.items():
        if _stale(store, tag, entries):
            done += [e.name for e in entries]
            clear(store, tag)
    return done


def _last_touched(paths: list[Path]) -> float:
    """The newest mtime/ctime of ``paths`` and of the entries of those that are directories."""
    stamps = [0.0]
    for p in paths:
        with contextlib.suppress(OSError):
            stamps += [p.stat().st_mtime, p.stat().st_ctime]
            if p.is_dir():
                stamps += [max(c.stat().st_mtime, c.stat().st_ctime) for c in p.iterdir()]
    return max(stamps)


def _stale(store: CheckpointStore, tag: str, entries: list[Path]) -> bool:
    """True when no live save can own ``tag``'s leftovers.

    Saves are serialized per directory within a job, but two jobs may share ``save_dir``, so a
    leftover is stale only when its save left no owner record (the record comes first and goes
    last), or the recorded process is dead (on this host its pid and start time tell), or, for
    an owner on another host (or a torn record), nothing in it changed for longer than the
    collectives' timeout, which a live save never lets pass (SAVE_TIMEOUT_S).
    """
    owner = Owner.of(store, tag)
    if owner is None:
        return True
    alive = owner.alive()
    if alive is None:
        return time.time() - _last_touched(entries) > SAVE_TIMEOUT_S
    return not alive


def clear(store: CheckpointStore, tag: str) -> None:
    """Remove ``tag``'s leftovers, moving its previous version back if the tag is missing."""
    final, old = store.root / tag, old_dir(store, tag)
    if not final.exists() and manifest_time(old) is not None:
        with contextlib.suppress(OSError):
            os.rename(old, final)
    for path in (store.tmp_dir(tag), old, latest_tmp(store, tag), owner_file(store, tag)):
        remove(path)
