"""The job's log directory on disk, safe where other users can write.

A ``--log_dir`` may lie where others can create files (``/tmp``, a shared project directory, a
working directory on a shared disk) while the job runs as root, and its files hold the command
line and tracebacks. The rules are ``dslaunch.safe_write``'s (a base others control, or a link to
it another user owns, is refused); on top of them, for logs:

- directories are private (0700), files too (0600);
- the job's own directory is made fresh (``mkdir``): one already there is an error, never reused;
- a file written again (a later run of the job) is replaced by a rename, never written through.
"""

from __future__ import annotations

import os

from dslaunch.errors import LaunchError, quote, shorten
from dslaunch.safe_write import UnsafePath, new_dir, open_dir, write_file

__all__ = ["open_job_dir", "replace_file"]

def _refuse(base: str, problem: str) -> LaunchError:
    return LaunchError(f"--log_dir {shorten(base, 300)}: {problem}")  # a path: its head and tail both matter


def _open_base(base: str) -> int:
    """Create ``base`` when missing (mode 0700) and open it, by ``safe_write``'s rule."""
    try:
        return open_dir(base, create=True, mode=0o700)
    except UnsafePath as err:
        raise LaunchError(f"--log_dir {err}") from None
    except OSError as err:
        raise _refuse(base, f"cannot create or open it as a directory: {err.strerror}") from None


def open_job_dir(path: str) -> int:
    """Make the job's directory ``path`` (its parent is the base ``--log_dir``); its descriptor.

    Raises:
        LaunchError: the base is refused (see ``safe_write.check_dir``), or ``path`` exists already.
    """
    base, name = os.path.split(path)
    base_fd = _open_base(base)
    try:
        return new_dir(base_fd, name, 0o700)
    except FileExistsError:
        raise _refuse(base, f"the job directory {quote(name)} is already there; a job never reuses one "
                            "(another user may have planted it): remove it or give another directory") from None
    except OSError as err:
        raise _refuse(base, f"cannot create the job directory {quote(name)}: {err.strerror}") from None
    finally:
        os.close(base_fd)


def replace_file(dir_fd: int, name: str, data: bytes) -> None:
    """``name`` in the directory now holds ``data`` (0600), whole or not at all (see
    ``safe_write.write_file``).

    Raises:
        OSError: the write failed (nothing is left behind).
    """
    write_file(dir_fd, name, data, mode=0o600)
