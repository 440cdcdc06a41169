"""Reading an input file a user gave (ds_config, ``.deepspeed_env``, a Hugging Face config.json,
a checkpoint description or manifest, a weights file's header), or one clear line why not.

The one place that decides what such a file may be: a regular file (a FIFO would block the
reader forever, ``/dev/zero`` would never end, a directory is no file), at most ``max_bytes``
(checked on the open file before anything is read, so a 1 GB file costs nothing), and for text:
UTF-8 (a leading byte-order mark is dropped) or UTF-16 with a byte-order mark (PowerShell's
``Out-File``/``>`` default). Invalid bytes and NUL characters are reported with their line.
``read_json`` parses such a text as JSON (the error with its line); ``read_head`` gives the first
bytes of a large binary file (a weights file's header) and ``check_file`` only the checks, for a
file a library then opens itself. Callers pass ``fail(message, line)``, which builds their own
``DslaunchError`` naming the file.
"""

from __future__ import annotations

import codecs
import json
import os
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["read_text", "read_json", "read_head", "check_file", "Fail"]

# Builds the caller's error from a message and a 1-based line number (None: the whole file).
Fail = Callable[[str, int | None], Exception]

_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def read_text(path: str | os.PathLike, max_bytes: int, fail: Fail) -> str:
    """The decoded text of ``path``.

    Raises:
        Exception: ``fail(message, line)``: unreadable, not a regular file, larger than
            ``max_bytes``, not valid UTF-8/UTF-16, or holding a NUL character.
    """
    return _decode(_read(path, max_bytes, max_bytes, fail), fail)


def read_json(path: str | os.PathLike, max_bytes: int, fail: Fail) -> Any:
    """The JSON value in ``path`` (checked as ``read_text``).

    Raises:
        Exception: ``fail(message, line)``, as ``read_text``, or not JSON (with its line).
    """
    text = read_text(path, max_bytes, fail)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise fail(f"not valid JSON ({err.msg}, column {err.colno})", err.lineno) from None
    except RecursionError:
        raise fail("not valid JSON (nested too deep)", None) from None


def read_head(path: str | os.PathLike, n: int, fail: Fail) -> tuple[bytes, int]:
    """The first ``n`` bytes of the regular file ``path`` (fewer when it is shorter) and its size.

    Raises:
        Exception: ``fail(message, None)``: unreadable or not a regular file.
    """
    size = check_file(path, None, fail)
    return _read(path, None, n, fail), size


def check_file(path: str | os.PathLike, max_bytes: int | None, fail: Fail) -> int:
    """The size of ``path`` once it is known to be a regular file of at most ``max_bytes``
    (None: any size), for a file a library opens itself.

    Raises:
        Exception: ``fail(message, None)``: unreadable, not a regular file, too large.
    """
    fd = _open(path, fail)
    try:
        return _checked(fd, max_bytes, fail)
    finally:
        os.close(fd)


def _open(path: str | os.PathLike, fail: Fail) -> int:
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}", None) from None
    except ValueError:  # os.open refuses a path holding a NUL byte
        raise fail("cannot read: the path holds a NUL byte", None) from None


def _checked(fd: int, max_bytes: int | None, fail: Fail) -> int:
    try:
        st = os.fstat(fd)
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}", None) from None
    if stat.S_ISDIR(st.st_mode):
        raise fail("is a directory, not a file", None)
    if not stat.S_ISREG(st.st_mode):
        raise fail("is not a regular file (a pipe or device cannot be read as one)", None)
    if max_bytes is not None and st.st_size > max_bytes:
        raise fail(f"is larger than {_size(max_bytes)}; this file is expected to be small", None)
    return st.st_size


def _read(path: str | os.PathLike, max_bytes: int | None, n: int, fail: Fail) -> bytes:
    """At most ``n`` bytes of the checked file; more than ``max_bytes`` (it grew) is refused."""
    fd = _open(path, fail)
    try:
        _checked(fd, max_bytes, fail)
        data = _read_at_most(fd, n + 1 if max_bytes is not None else n)
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}", None) from None
    finally:
        os.close(fd)
    if max_bytes is not None and len(data) > max_bytes:
        raise fail(f"is larger than {_size(max_bytes)}; this file is expected to be small", None)
    return data


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit:
        chunk = os.read(fd, min(limit - size, 2**20))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _size(n: int) -> str:
    return f"{n // 2**20} MiB" if n % 2**20 == 0 else f"{n} bytes"


def _decode(data: bytes, fail: Fail) -> str:
    encoding = "utf-16" if data.startswith(_UTF16_BOMS) else "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as err:
        line = data[:err.start].decode(encoding, errors="replace").count("\n") + 1
        name = "UTF-16" if encoding == "utf-16" else "UTF-8"
        raise fail(f"not valid {name} (byte 0x{data[err.start]:02x}); save the file as UTF-8", line) from None
    nul = text.find("\0")
    if nul >= 0:
        raise fail("holds a NUL character (UTF-16 without a byte-order mark?); save the file as UTF-8",
                   text.count("\n", 0, nul) + 1)
    return text
