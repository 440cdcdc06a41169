"""The job's log directory on disk, safe where other users can write.

A ``--log_dir`` may lie where others can create files (``/tmp``, a shared project directory, a
working directory on a shared disk) while the job runs as root, and its files hold the command
line and tracebacks. So:

- the base directory (``--log_dir``) must be owned by this user (or root) and must not be writable
  by others unless it is sticky (as ``/tmp``); a symbolic link there is followed only when this
  user (or root) owns the link, so a planted ``./dslaunch_logs`` cannot move the logs elsewhere;
- the job's own directory is made fresh (``mkdir``, mode 0700): one already there is an error,
  never reused;
- every file in it is opened relative to the directory's descriptor, never through a link
  (``O_NOFOLLOW``), mode 0600; a file written again (a later run of the job) is replaced by a
  rename, never written through.
"""

from __future__ import annotations

import os
import stat

from dslaunch.errors import LaunchError, quote, shorten
from dslaunch.launcher.agent.files import create_new, write_all

__all__ = ["open_job_dir", "replace_file"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _refuse(base: str, problem: str) -> LaunchError:
    return LaunchError(f"--log_dir {shorten(base, 300)}: {problem}")  # a path: its head and tail both matter


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def _check_base(base: str, st: os.stat_result) -> None:
    """Refuse a base directory others could plant files or links in.

    Raises:
        LaunchError: owned by another user, or writable by others without the sticky bit.
    """
    if not _trusted(st.st_uid):
        raise _refuse(base, f"owned by another user (uid {st.st_uid}); the job's logs hold its command "
                            "line and tracebacks: give a directory you own")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise _refuse(base, "writable by every user and not sticky: others could replace the job's files; "
                            "give another directory, or 'chmod o-w' it")


def _open_base(base: str) -> int:
    """Create ``base`` when missing (mode 0700) and open it, after the checks of ``_check_base``."""
    try:
        link = os.lstat(base)
    except FileNotFoundError:
        link = None
    except OSError as err:
        raise _refuse(base, f"cannot read it: {err.strerror}") from None
    followed = link is not None and stat.S_ISLNK(link.st_mode)
    if followed and not _trusted(link.st_uid):
        raise _refuse(base, f"a symbolic link owned by another user (uid {link.st_uid}); not followed: "
                            "give the directory itself")
    try:
        if link is None:
            os.makedirs(base, mode=0o700, exist_ok=True)
        # Not a link when looked at: one put there since is not followed either.
        fd = os.open(base, _DIR_FLAGS | (0 if followed else os.O_NOFOLLOW))
    except OSError as err:
        raise _refuse(base, f"cannot create or open it as a directory: {err.strerror}") from None
    try:
        _check_base(base, os.fstat(fd))
    except LaunchError:
        os.close(fd)
        raise
    return fd


def open_job_dir(path: str) -> int:
    """Make the job's directory ``path`` (its parent is the base ``--log_dir``); its descriptor.

    Raises:
        LaunchError: the base is refused (see ``_check_base``), or ``path`` exists already.
    """
    base, name = os.path.split(path)
    base_fd = _open_base(base)
    try:
        os.mkdir(name, 0o700, dir_fd=base_fd)
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=base_fd)
    except FileExistsError:
        raise _refuse(base, f"the job directory {quote(name)} is already there; a job never reuses one "
                            "(another user may have planted it): remove it or give another directory") from None
    except OSError as err:
        raise _refuse(base, f"cannot create the job directory {quote(name)}: {err.strerror}") from None
    finally:
        os.close(base_fd)


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in the directory now holds ``data`` (0600), whole or not at all: written to a new
    temporary file, then renamed over it (a link there is replaced, never followed).

    Raises:
        OSError: the write failed (nothing is left behind).
    """
    tmp = f".{name}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)  # left by a write that failed and could not clean up
    except FileNotFoundError:
        pass
    fd = create_new(tmp, dir_fd=dir_fd)
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
