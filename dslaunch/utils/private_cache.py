"""Owner-only caches under the user's home (the CPU kernels, the measured CPU peak): the rules for
trusting what is found there, in one place.

A cache another user can write is a way into every job that loads it (a planted kernel library) or
a way to skew it (a planted peak), so directories are created 0700 and every file is opened without
following links and checked for owner and mode before use. This module owns the reading side;
writes go through ``dslaunch.safe_write``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from dslaunch.safe_write import open_dir


class Untrusted(Exception):
    """A cache directory or file that another user could have written; the message says why."""


def check_owner(fd: int, what: str) -> None:
    """Raise ``Untrusted`` unless ``fd`` is this user's and nobody else may write it."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise Untrusted(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise Untrusted(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):04o})")


def make_private_dirs(folder: Path) -> None:
    """Create the missing directories of ``folder``, each 0700, by ``safe_write``'s rule (no link
    another user owns is followed); whether the result is trusted is ``check_owner``'s to say.

    Raises:
        OSError: a part cannot be made, or is a link another user owns (``UnsafePath``).
    """
    os.close(open_dir(folder, create=True, mode=0o700, check=False))


def open_private_file(path: str | Path, dir_fd: int | None = None) -> int:
    """A read-only descriptor of a cached file after checking it is a regular file of this user's.

    Raises:
        FileNotFoundError: there is no such file.
        OSError: it cannot be opened (a symlink, permissions...).
        Untrusted: it is not a regular file, or another user could have written it.
    """
    # O_NOFOLLOW: not a symlink's target; O_NONBLOCK: a planted FIFO does not hang the open.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Untrusted("it is not a regular file")
        check_owner(fd, "it")
    except Untrusted:
        os.close(fd)
        raise
    return fd
