"""Files the launcher writes where other users may write too: ``/tmp`` (``--save_pid``) and the
``--enable_each_rank_log`` directory.

A plain ``open(path, "w")`` follows a symlink and truncates what it points at: with
``fs.protected_symlinks=0``, another local user could plant ``/tmp/<next pid>.deepspeed ->
/etc/shadow`` and let a root ``dslaunch --save_pid`` overwrite it (a hard link works the same way
with ``fs.protected_hardlinks=0``). So every file here is created new, with
``O_CREAT|O_EXCL|O_NOFOLLOW``: whatever already exists at the path (file, link, FIFO) is never
opened. A file is removed only while the path still names the very file we created.
"""

from __future__ import annotations

import os

__all__ = ["FileId", "create_new", "create_replacing", "write_new", "write_all", "remove_own"]

FileId = tuple[int, int]
"""(device, inode): which file a path named when we created it."""

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def create_new(path: str, mode: int = 0o600, dir_fd: int | None = None) -> int:
    """A write-only fd on a file that did not exist before this call (``path`` relative to
    ``dir_fd`` when given).

    Raises:
        FileExistsError: anything is at ``path`` already (a link too: it is not followed).
        OSError: the directory is missing or not writable.
    """
    return os.open(path, _NEW, mode, dir_fd=dir_fd)


def create_replacing(path: str, mode: int = 0o600) -> int:
    """Like ``create_new``, but an old file at ``path`` is unlinked first (its contents and any
    file a link there points at are left alone): the ``O_TRUNC`` of a log file, without writing
    through a link, a FIFO or a hard link someone else planted.

    Raises:
        OSError: ``path`` is a directory, or cannot be unlinked or created (e.g. another user's
            file in a sticky directory such as /tmp).
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    return create_new(path, mode)


def write_new(path: str, data: bytes, mode: int = 0o600) -> FileId:
    """Write ``data`` to a new file at ``path`` (see ``create_new``); returns its id for ``remove_own``."""
    fd = create_new(path, mode)
    try:
        write_all(fd, data)
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (``os.write`` may write part of it); OSError as it comes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def remove_own(path: str, ident: FileId) -> None:
    """Unlink ``path`` if it still names the file ``ident`` (else it is not ours to remove)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except OSError:  # already gone, or the directory went away: nothing of ours is left
        pass
