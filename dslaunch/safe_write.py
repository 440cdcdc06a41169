"""Every file dslaunch writes on a user's behalf: one rule, in one place.

Launcher logs, monitor files, the flops profiler's output, autotuning results, checkpoints, the
kernel and peak caches and exports may lie in a directory other local users can reach, while the
job runs as root. A plain ``open(path, "w")`` follows a symbolic link planted there and truncates
whatever it points at (``/etc/shadow``), and ``os.makedirs`` creates directories wherever a link
leads. So, for every write through this module:

- a directory is reached one component at a time, relative to its parent's descriptor
  (``O_DIRECTORY|O_NOFOLLOW``); a symbolic link on the way is followed only when this user (or
  root) owns it, so a link another user planted never moves the output elsewhere;
- the directory written into, and any directory one is created in, must be this user's (or
  root's) and not writable by others unless it is sticky (``/tmp``); otherwise ``UnsafePath``
  names it (the rule of the launcher's log directory, the first writer here). Group-writable
  directories are accepted: a team's shared project directory is one, and no write below follows
  a link anyway;
- directories it creates are this user's, mode 0755 (0700 for private ones) before the umask;
- a file is never opened through a link: new files are created exclusively
  (``O_CREAT|O_EXCL|O_NOFOLLOW``); a replaced file is written to a temporary file with an
  unpredictable name and renamed over the old one (a link there is replaced, not followed); a file
  appended to must be a regular file of this user's with one link (no FIFO, no planted hard link).

Callers decide what a refusal means: an observer (monitor, profiler) warns in one line and the job
goes on; a checkpoint or an autotuning result raises an error naming the path.

A small API for any new writer: ``open_dir``/``make_dirs``/``new_dir`` for directories,
``write_file`` (whole, replacing), ``append_file``, ``create_new``, ``take_over`` (an old file's pages
reused under a new name), ``atomic_path`` for a library that only takes a file name, and
``private_temp_dir`` for a tool's own scratch directory. ``tests/test_safe_write_callers.py`` fails on a write elsewhere.

Limitations: Linux/POSIX only (``openat``-style ``dir_fd`` calls). A directory the job only reads
is not checked here.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Union

__all__ = ["UnsafePath", "Where", "FileId", "open_dir", "make_dirs", "new_dir", "check_dir", "create_new", "take_over",
           "create_reusing",
           "create_replacing", "write_new", "write_file", "atomic_file", "atomic_path", "append_file", "lock_file",
           "write_all",
           "remove_file", "remove_own", "split_path", "explain", "private_temp_dir"]

Where = Union[int, str, "os.PathLike[str]"]
"""A directory: an open descriptor (from ``open_dir``) or a path (opened, and created if missing)."""

FileId = tuple[int, int]
"""(device, inode): which file a path named when we created it."""

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO planted where an append goes fails the open (ENXIO) instead of hanging it.
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class UnsafePath(PermissionError):
    """A path this module will not write through; ``str()`` is one line naming it and why."""

    def __init__(self, path: str, problem: str):
        super().__init__(errno.EPERM, problem, path)  # .filename, .strerror: as any OSError's

    def __str__(self) -> str:
        return f"{_short(self.filename)}: {self.strerror}"


def _short(path: str) -> str:
    text = repr(path)[1:-1] if not path.isprintable() else path
    return text if len(text) <= 300 else f"{text[:140]}...{text[-140:]}"  # head and tail both matter


def explain(err: OSError, path: str | os.PathLike[str]) -> str:
    """One line for a failed write: ``UnsafePath``'s own, else ``<file>: <strerror>`` (``path`` when
    the error names no file, or only a name relative to a descriptor)."""
    if isinstance(err, UnsafePath):
        return str(err)
    name = err.filename if isinstance(err.filename, str) and "/" in err.filename else os.fspath(path)
    return f"{_short(name)}: {err.strerror or err}"


def _shown(where: Where, name: str) -> str:
    return name if isinstance(where, int) else os.path.join(os.fspath(where), name)


def _trusted(uid: int) -> bool:
    return uid in (os.geteuid(), 0)


def check_dir(fd: int, path: str) -> None:
    """Refuse the directory open as ``fd`` (named ``path`` in the message) if another user could
    plant files or links in it.

    Raises:
        UnsafePath: owned by another user (not root), or writable by every user and not sticky.
    """
    st = os.fstat(fd)
    if not _trusted(st.st_uid):
        raise UnsafePath(path, f"directory owned by another user (uid {st.st_uid}); dslaunch writes only "
                               "into directories of this user's (or root's): give one you own")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(path, "directory writable by every user and not sticky: others could replace "
                               "the files written there; give another directory, or 'chmod o-w' it")


def _step(parent: int, name: str, shown: str, create: bool, mode: int, check: bool) -> int:
    """Open the directory ``name`` under ``parent``: a link only if trusted, created if missing
    (``check``: only in a parent ``check_dir`` accepts, which could otherwise swap it later)."""
    try:
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        if check:
            check_dir(parent, os.path.dirname(shown) or ".")
        try:
            os.mkdir(name, mode, dir_fd=parent)
        except FileExistsError:  # made meanwhile (another rank): opened below like any other
            pass
        return _step(parent, name, shown, False, mode, False)
    except OSError as err:  # ELOOP / ENOTDIR: a link, or not a directory
        st = os.lstat(name, dir_fd=parent)
        if not stat.S_ISLNK(st.st_mode):
            err.filename = shown
            raise
        if not _trusted(st.st_uid):
            raise UnsafePath(shown, f"a symbolic link owned by another user (uid {st.st_uid}); not "
                                    "followed: give the directory itself") from None
        return os.open(name, _DIR, dir_fd=parent)


def open_dir(path: str | os.PathLike[str], create: bool = True, mode: int = 0o755,
             check: bool = True) -> int:
    """A descriptor of the directory ``path``, reached without following links another user owns,
    its missing parts created (``mode``, before the umask) when ``create``. Close it when done.

    Args:
        path: absolute, or relative to the working directory.
        create: make missing directories (else FileNotFoundError).
        mode: of the directories made: 0o755 for outputs, 0o700 for private ones (logs, caches).
        check: refuse the final directory per ``check_dir``, and any directory a missing part
            would be made in.

    Raises:
        UnsafePath: a link on the way owned by another user, or the directory fails ``check_dir``.
        OSError: a part is missing (``create=False``), not a directory, or cannot be made.
    """
    text = os.fspath(path)
    if not text:
        raise FileNotFoundError("an empty path names no directory")
    parts = [p for p in text.split("/") if p not in ("", ".")]
    fd = os.open("/" if text.startswith("/") else ".", _DIR)
    try:
        for i, part in enumerate(parts):
            shown = ("/" if text.startswith("/") else "") + "/".join(parts[:i + 1])
            nxt = _step(fd, part, shown, create, mode, check)
            os.close(fd)
            fd = nxt
        if check:
            check_dir(fd, text)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dirs(path: str | os.PathLike[str], mode: int = 0o755) -> None:
    """``os.makedirs(path, exist_ok=True)`` by this module's rule (see ``open_dir``).

    Raises:
        UnsafePath, OSError: as ``open_dir``.
    """
    os.close(open_dir(path, create=True, mode=mode))


@contextlib.contextmanager
def _dir(where: Where, mode: int = 0o755) -> Iterator[int]:
    """``where`` as a descriptor: a given one is borrowed, a path is opened (and closed after)."""
    if isinstance(where, int):
        yield where
        return
    fd = open_dir(where, create=True, mode=mode)
    try:
        yield fd
    finally:
        os.close(fd)


def new_dir(where: Where, name: str, mode: int = 0o755) -> int:
    """Make the directory ``name`` in ``where``, new (never one already there), and open it.

    Raises:
        FileExistsError: anything is at ``name`` already (a link too: it is not followed).
        UnsafePath, OSError: as ``open_dir`` when ``where`` is a path; it cannot be made.
    """
    with _dir(where) as dir_fd:
        os.mkdir(name, mode, dir_fd=dir_fd)
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dir_fd)


def split_path(path: str | os.PathLike[str]) -> tuple[str, str]:
    """``(directory, name)`` of a file path, the directory "." when none is given.

    Raises:
        IsADirectoryError: the path ends in "/" or names "." or "..": no file name.
    """
    head, name = os.path.split(os.fspath(path))
    if name in ("", ".", ".."):
        raise IsADirectoryError(f"{_short(os.fspath(path))}: names a directory, not a file")
    return head or ".", name


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` (``os.write`` may write part of it); OSError as it comes."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def create_new(where: Where, name: str, mode: int = 0o600, readable: bool = False) -> int:
    """A write-only descriptor of a file that did not exist before this call (``readable``: read
    and write, as a shared memory map of it needs).

    Raises:
        FileExistsError: anything is at ``name`` already (a link too: it is not followed).
        UnsafePath, OSError: as ``open_dir`` when ``where`` is a path; the directory is not writable.
    """
    flags = (_NEW & ~os.O_WRONLY) | os.O_RDWR if readable else _NEW
    with _dir(where) as dir_fd:
        return os.open(name, flags, mode, dir_fd=dir_fd)


def take_over(where: Where, name: str, old_where: Where, old_name: str) -> int:
    """A read-write descriptor of the file ``old_name`` in ``old_where``, moved to ``name`` in
    ``where`` (new there) to be overwritten in place: on a tmpfs its pages are reused, so writing it
    allocates, zeroes and later frees no memory. The move is exclusive (a hard link, which fails
    when anything is at ``name``, then the old name unlinked) and the file is kept only when it is
    a regular file of this user's with one link; it is never opened through a link.

    Raises:
        FileExistsError, FileNotFoundError, UnsafePath, OSError: nothing was opened; ``name`` is
            as it was (the old file may be gone).
    """
    with _dir(where) as dir_fd, _dir(old_where) as old_fd:
        os.link(old_name, name, src_dir_fd=old_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        try:
            os.unlink(old_name, dir_fd=old_fd)
            return _open_own(dir_fd, name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=dir_fd)
            raise


def create_reusing(where: Where, name: str, reuse: Path | None, mode: int = 0o600,
                   readable: bool = False) -> tuple[int, bool]:
    """``take_over`` of ``reuse`` (a file path) to ``name`` in ``where`` where it can be (it is
    there, and a regular file of this user's with one link), else ``create_new``; and whether the
    file is ``reuse`` (then it holds old bytes to overwrite or truncate).

    Raises:
        FileExistsError, UnsafePath, OSError: as ``create_new``.
    """
    if reuse is not None:
        try:
            return take_over(where, name, str(reuse.parent), reuse.name), True
        except OSError:  # gone, or not a file of ours: a new one serves as well
            pass
    return create_new(where, name, mode, readable), False


def create_replacing(where: Where, name: str, mode: int = 0o600) -> int:
    """Like ``create_new``, but an old file at ``name`` is unlinked first (its contents and any
    file a link there points at are left alone): the ``O_TRUNC`` of a log file, without writing
    through a link, a FIFO or a hard link someone else planted.

    Raises:
        OSError: ``name`` is a directory, or cannot be unlinked or created (e.g. another user's
            file in a sticky directory such as /tmp).
    """
    with _dir(where) as dir_fd:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)
        return os.open(name, _NEW, mode, dir_fd=dir_fd)


def write_new(path: str | os.PathLike[str], data: bytes, mode: int = 0o600) -> FileId:
    """Write ``data`` to a new file at ``path`` (see ``create_new``); its id, for ``remove_own``.

    Raises:
        FileExistsError, UnsafePath, OSError: as ``create_new``.
    """
    try:
        fd = create_new(*split_path(path), mode)
    except OSError as err:
        err.filename = os.fspath(path)
        raise
    try:
        write_all(fd, data)
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def remove_own(path: str | os.PathLike[str], ident: FileId) -> None:
    """Unlink ``path`` if it still names the file ``ident`` (else it is not ours to remove)."""
    try:
        st = os.lstat(path)
        if (st.st_dev, st.st_ino) == ident:
            os.unlink(path)
    except OSError:  # already gone, or the directory went away: nothing of ours is left
        pass


def _tmp_name(name: str) -> str:
    """An unpredictable temporary name beside ``name``: none a neighbour could plant in advance."""
    return f".{name[:200]}.{secrets.token_hex(6)}.tmp"


@contextlib.contextmanager
def _renamed_onto(dir_fd: int, tmp: str, name: str, durable: bool) -> Iterator[None]:
    """The block fills ``tmp``; then it is renamed onto ``name`` (the directory fsynced when
    ``durable``). On an error ``tmp`` is removed and ``name`` left as it was."""
    try:
        yield
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        os.fsync(dir_fd)


@contextlib.contextmanager
def atomic_file(where: Where, name: str, mode: int = 0o644, durable: bool = False) -> Iterator[IO[bytes]]:
    """A binary file that becomes ``name`` in ``where`` when the block ends without an error:
    written to a new temporary file (an unpredictable ``.<name>.<random>.tmp``, created
    exclusively), then renamed over ``name`` (a link or file there is replaced, never written
    through). On an error the temporary file is removed and ``name`` is left as it was.

    Args:
        durable: fsync the file before the rename and the directory after it.

    Raises:
        UnsafePath, OSError: as ``open_dir`` / the write / the rename.
    """
    with _dir(where) as dir_fd:
        tmp = _tmp_name(name)
        f = os.fdopen(os.open(tmp, _NEW, mode, dir_fd=dir_fd), "wb")
        with _renamed_onto(dir_fd, tmp, name, durable), f:
            yield f
            f.flush()
            if durable:
                os.fsync(f.fileno())


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], tmp_name: str | None = None, mode: int = 0o644,
                durable: bool = False) -> Iterator[Path]:
    """For writers that take only a file name (``torch.save``, safetensors' ``save_file``): the
    path of a new, empty temporary file beside ``path``, renamed onto ``path`` when the block ends
    without an error (removed otherwise). Safe to open by name: this call created the file
    exclusively, in a directory ``open_dir`` accepted, so no other user can have replaced it.

    Args:
        tmp_name: the temporary file's name (a leftover of that name is removed first); default
            an unpredictable ``.<name>.<random>.tmp``.
        durable: fsync the file before the rename and the directory after it.

    Raises:
        UnsafePath, OSError: as ``open_dir`` / the write / the rename.
    """
    head, name = split_path(path)
    with _dir(head) as dir_fd:
        tmp = tmp_name or _tmp_name(name)
        if tmp_name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=dir_fd)
        os.close(os.open(tmp, _NEW, mode, dir_fd=dir_fd))
        with _renamed_onto(dir_fd, tmp, name, durable):
            yield Path(head) / tmp
            if durable:  # what the writer wrote by name: fsynced through a descriptor of our file
                fd = os.open(tmp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def write_file(where: Where, name: str, data: bytes | str, replace: bool = True, mode: int = 0o644,
               durable: bool = False) -> None:
    """``name`` in ``where`` holds ``data`` (str is written as UTF-8).

    Args:
        replace: whole or not at all, replacing what is there (see ``atomic_file``); False: the
            file must be new (``create_new``: FileExistsError when anything is there).
        durable: fsync (see ``atomic_file``).

    Raises:
        UnsafePath, OSError: as ``atomic_file`` / ``create_new``.
    """
    body = data.encode() if isinstance(data, str) else data
    if replace:
        with atomic_file(where, name, mode, durable) as f:
            f.write(body)
        return
    fd = create_new(where, name, mode)
    try:
        write_all(fd, body)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def append_file(where: Where, name: str, mode: int = 0o644, text: bool = True) -> IO:
    """``name`` in ``where`` opened for appending (created if missing): a regular file of this
    user's with one link, never through a link. Text mode writes UTF-8 with ``\\n`` line ends.

    Raises:
        UnsafePath: it is not a regular file, not this user's, or has other hard links.
        UnsafePath, OSError: as ``open_dir`` when ``where`` is a path; the open fails.
    """
    raw = os.fdopen(_open_own(where, name, _APPEND, mode), "ab")
    return io.TextIOWrapper(raw, encoding="utf-8", newline="") if text else raw


def lock_file(where: Where, name: str) -> int:
    """A read-write descriptor of the lock file ``name`` in ``where`` (created if missing, mode
    0600, shared by every process that locks it): like ``append_file``, never through a link, and
    only a regular file of this user's with one link. Lock it with ``fcntl.flock``.

    Raises:
        UnsafePath, OSError: as ``append_file``.
    """
    return _open_own(where, name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)


def _open_own(where: Where, name: str, flags: int, mode: int) -> int:
    """``name`` opened with ``flags`` (which hold O_NOFOLLOW and O_NONBLOCK: a FIFO never blocks
    the open), kept only when it is a regular file of this user's with one link; blocking again."""
    with _dir(where) as dir_fd:
        try:
            fd = os.open(name, flags, mode, dir_fd=dir_fd)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.ENXIO):
                raise UnsafePath(_shown(where, name), "a symbolic link or FIFO is there; not written through: remove it") from None
            raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(_shown(where, name), "not a regular file; not written through: remove it")
        if st.st_uid != os.geteuid() or st.st_nlink != 1:
            raise UnsafePath(_shown(where, name), f"owned by uid {st.st_uid} with {st.st_nlink} link(s): only a file of "
                                   "this user's with one link is opened; remove it")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_file(where: Where, name: str) -> None:
    """Unlink ``name`` in ``where`` if there (never what a link there points at)."""
    with _dir(where) as dir_fd, contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def private_temp_dir(prefix: str) -> str:
    """A new directory of this user's, mode 0700, with an unpredictable name in the system's
    temporary directory (``tempfile.mkdtemp``: created exclusively, so nothing planted is reused).
    The caller removes it (``shutil.rmtree``) when its tool is done with it."""
    return tempfile.mkdtemp(prefix=prefix)
