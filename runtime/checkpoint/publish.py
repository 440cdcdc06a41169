"""One save of a tag, as its leader performs it on ``save_dir``.

Owns every step of a save that changes what the loader sees, and its reversal. ``LeaderSave``:
``begin`` (clear stale leftovers, record the owner, create ``.tmp-<tag>``) -> the ranks write their
files -> ``install`` (manifest, rename into place, ``latest``) -> ``commit`` (drop the tag's previous
version, retention) or ``roll_back`` (remove exactly what this save created, put back what it
replaced) -> ``describe`` says what is on disk then. The entries a save creates besides the tag
and ``latest``, and the cleanup of those killed saves leave, are ``leftovers.py``'s.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from dslaunch.errors import CheckpointError
from dslaunch.runtime.checkpoint.leftovers import (
    Owner,
    clear,
    latest_tmp,
    manifest_time,
    old_dir,
    owner_file,
    remove,
    remove_stale,
)
from dslaunch.runtime.checkpoint.store import (
    LATEST,
    MANIFEST,
    CheckpointStore,
    FileRecord,
    Manifest,
    fsync_dir,
    validate_tag,
    write_atomic,
)
from dslaunch.safe_write import UnsafePath, make_dirs, new_dir, write_file

__all__ = ["LeaderSave"]

_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux renameat2); False when the platform can't."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd = -100
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _read_bytes(path: Path) -> bytes | None:
    """The file's content, or None when it does not exist (or cannot be read). Never through a
    link (one planted as ``latest`` would put another file's content into a message), at most
    what a ``latest`` can hold."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096) if stat.S_ISREG(os.fstat(fd).st_mode) else None
    except OSError:
        return None
    finally:
        os.close(fd)


# ---- one save -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Before:
    """``latest`` and the tag as the save found them (so a failure can say what changed)."""

    latest: bytes | None  # the content of ``latest``; None: there was none
    tag_created: float | None  # the tag's manifest time; None: no such tag


class LeaderSave:
    """The leader's side of one save of ``tag``: it remembers what it created, so that
    ``roll_back`` removes exactly that and puts back what it replaced."""

    def __init__(self, store: CheckpointStore, tag: str) -> None:
        self.store, self.tag = store, tag
        self.manifest: Manifest | None = None
        self._before: _Before | None = None
        self._started = False  # the owner record and ``.tmp-<tag>`` exist
        self._displaced: Path | None = None  # where the tag's previous version waits
        self._installed = False  # the tag is in place (``latest`` may name it), not committed
        self._latest_before: bytes | None = None

    @property
    def installed(self) -> bool:
        """The tag is in place and ``latest`` names it (when asked to), not yet committed."""
        return self._installed

    def begin(self) -> None:
        """Clear stale leftovers (of ``tag``: whoever left them, this save is about to write
        it), record this process as the owner and create an empty ``.tmp-<tag>``.

        Raises:
            CheckpointError: the tag is invalid, or a live process on this host saves it here.
            OSError: ``roll_back`` removes what was created.
        """
        store, tag = self.store, self.tag
        validate_tag(tag)
        try:
            make_dirs(store.root)  # safe_write's rule: save_dir no other user controls
        except UnsafePath as err:
            raise CheckpointError(f"{err.strerror}; the checkpoint is not written", err.filename) from None
        owner = Owner.of(store, tag)
        if owner is not None and owner.alive():
            raise CheckpointError(f"another save of tag {tag!r} is in progress here (process "
                                  f"{owner.pid} on {owner.host}): save under another tag or "
                                  "directory", str(owner_file(store, tag)))
        remove_stale(store)
        clear(store, tag)
        self._before = _Before(_read_bytes(store.root / LATEST), manifest_time(store.root / tag))
        self._started = True
        write_file(store.root, owner_file(store, tag).name, Owner.me().to_json())
        os.close(new_dir(store.root, store.tmp_dir(tag).name))

    def install(self, records: list[FileRecord], meta: dict, save_latest: bool = True,
                library_version: str = "") -> Manifest:
        """Write the manifest, move the tag into place, then point ``latest`` at it.

        The tag's previous version (if any) is kept aside until ``commit``. Raises what failed,
        after undoing the move and ``latest``; ``roll_back`` removes the rest.
        """
        store, tag, tmp = self.store, self.tag, self.store.tmp_dir(self.tag)
        self.manifest = Manifest(tag=tag, created=time.time(), files={r.name: r for r in records},
                                 meta=meta, library_version=library_version)
        write_file(tmp, MANIFEST, self.manifest.to_json(), replace=False, durable=store.durable)
        fsync_dir(tmp, store.durable)
        self._displaced = self._move_into_place(tmp)
        self._installed = True
        latest = store.root / LATEST
        self._latest_before = _read_bytes(latest)
        try:
            fsync_dir(store.root, store.durable)
            if save_latest:
                write_atomic(latest, lambda p: p.write_text(tag), store.durable, latest_tmp(store, tag))
        except BaseException:
            self.roll_back()
            raise
        return self.manifest

    def _move_into_place(self, tmp: Path) -> Path | None:
        """Rename ``tmp`` to the tag. Returns where the tag's previous version now is (None: the
        tag is new). On failure ``tmp`` still holds the new files and the tag the previous ones."""
        final, old = self.store.root / self.tag, old_dir(self.store, self.tag)
        if not final.exists():
            os.rename(tmp, final)
            return None
        remove(old)
        if _exchange(tmp, final):  # atomic: readers never find the tag missing
            try:
                os.rename(tmp, old)  # so that ``.tmp-<tag>`` only ever holds this save's files
            except BaseException:
                if _exchange(tmp, final):
                    raise
                return tmp  # cannot swap back: the new tag stays, the previous one waits in tmp
            return old
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):  # else the next save moves it back (remove_stale)
                os.rename(old, final)
            raise
        return old

    def commit(self, keep_last: int = 0) -> list[str]:
        """Once every leader installed the tag: drop its previous version and the owner record,
        then apply retention (``keep_last`` > 0: delete older tags so that this many remain,
        never this tag nor the one ``latest`` names). Returns the deleted tags; raises OSError
        when retention fails (the new tag and ``latest`` are complete by then)."""
        if self._displaced is not None:
            with contextlib.suppress(OSError):  # else the next save removes it
                self.store.discard(self._displaced)
        self._installed = False
        self._end()
        return self.store.retain(keep_last, protect={self.tag}) if keep_last > 0 else []

    def roll_back(self) -> str:
        """After a failure (here or on another rank): remove what this save created and put
        back what it replaced, ``latest`` first. Best effort: never raises, and never removes
        the new tag while ``latest`` names it.

        Returns:
            What ``latest`` and the tag hold now, and any leftover (``describe``).
        """
        if self._installed:
            self._undo_install()
        elif self._started:
            shutil.rmtree(self.store.tmp_dir(self.tag), ignore_errors=True)
        if self._started:
            self._end()
        return self.describe()

    def _undo_install(self) -> None:
        store, before = self.store, self._latest_before
        final, latest = store.root / self.tag, store.root / LATEST
        self._installed = False
        if _read_bytes(latest) != before:
            with contextlib.suppress(OSError):
                if before is None:
                    latest.unlink()
                else:
                    write_atomic(latest, lambda p: p.write_bytes(before), store.durable,
                                 latest_tmp(store, self.tag))
            if _read_bytes(latest) != before:
                return
        with contextlib.suppress(OSError):
            if self._displaced is None:
                store.discard(final)
            elif _exchange(self._displaced, final):
                store.discard(self._displaced)
            else:
                store.discard(final)
                os.rename(self._displaced, final)
            fsync_dir(store.root, store.durable)

    def _end(self) -> None:
        """The save is over: remove its ``latest`` temp file, then its owner record (last: while
        it exists, other saves leave this save's files alone)."""
        self._started = False
        for path in (latest_tmp(self.store, self.tag), owner_file(self.store, self.tag)):
            remove(path)

    def describe(self) -> str:
        """What ``latest`` and the tag hold now, compared with the save's start, and what the
        save left over: the end of a failed save's message."""
        store, tag, before = self.store, self.tag, self._before
        latest = store.root / LATEST
        now = _read_bytes(latest)
        named = repr(_clip(now.decode(errors="replace").strip())) if now is not None else ""
        if before is not None and now == before.latest:
            parts = [f"{latest} still names {named}" if now is not None else f"there is still no {latest}"]
        else:
            parts = [f"{latest} names {named}" if now is not None else f"there is no {latest}"]
        have, old = manifest_time(store.root / tag), old_dir(store, tag)
        if have is not None and self.manifest is not None and have == self.manifest.created:
            parts.append(f"tag {tag!r} is complete (the new version)")
        elif have is not None and before is not None and have == before.tag_created:
            parts.append(f"tag {tag!r} is unchanged")
        elif have is not None:
            parts.append(f"tag {tag!r} exists")
        elif (store.root / tag).exists():
            parts.append(f"{store.root / tag} is not a complete checkpoint")
        elif manifest_time(old) is not None:
            parts.append(f"tag {tag!r} is missing: its previous version is in {old} (the next save "
                         "moves it back)")
        else:
            parts.append(f"no tag {tag!r} was published")
        for left in (store.tmp_dir(tag), latest_tmp(store, tag)) + ((old,) if have else ()):
            if left.exists():
                parts.append(f"{left} is left over (it is never loaded; the next save removes it)")
        return ", ".join(parts)


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
