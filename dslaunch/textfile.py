"""Reading a small text file a user wrote (ds_config, ``.deepspeed_env``), or one clear line why not.

The one place that decides what such a file may be: a regular file (a FIFO would block the
reader forever, ``/dev/zero`` would never end), at most ``max_bytes``, and text: UTF-8 (a
leading byte-order mark is dropped) or UTF-16 with a byte-order mark (PowerShell's
``Out-File``/``>`` default). Invalid bytes and NUL characters are reported with their line.
Callers pass ``fail(message, line)``, which builds their own ``DslaunchError`` naming the file.
"""

from __future__ import annotations

import codecs
import os
import stat
from collections.abc import Callable

__all__ = ["read_text", "Fail"]

# Builds the caller's error from a message and a 1-based line number (None: the whole file).
Fail = Callable[[str, int | None], Exception]

_UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def read_text(path: str | os.PathLike, max_bytes: int, fail: Fail) -> str:
    """The decoded text of ``path``.

    Raises:
        Exception: ``fail(message, line)``: unreadable, not a regular file, larger than
            ``max_bytes``, not valid UTF-8/UTF-16, or holding a NUL character.
    """
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; regular files ignore it.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}", None) from None
    except ValueError:  # os.open refuses a path holding a NUL byte
        raise fail("cannot read: the path holds a NUL byte", None) from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise fail("is a directory, not a file", None)
        if not stat.S_ISREG(mode):
            raise fail("is not a regular file (a pipe or device cannot be read as one)", None)
        data = _read_at_most(fd, max_bytes + 1)
    except OSError as err:
        raise fail(f"cannot read: {err.strerror}", None) from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise fail(f"is larger than {_size(max_bytes)}; this file is expected to be small", None)
    return _decode(data, fail)


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
