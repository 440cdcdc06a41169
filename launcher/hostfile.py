"""Hostfiles (DeepSpeed syntax) and the ``--include``/``--exclude`` slot filter.

Hostfile syntax, one host per line::

    # comment
    worker-1 slots=4     # trailing comments too
    worker-2 slots=4

Every mistake is a ``HostfileError`` naming the file and line: duplicate host (host names are
case-insensitive), invalid host name, ``slots`` missing, zero, negative or not plain ASCII digits,
unknown keys, trailing junk, invalid UTF-8, a character other than printable ASCII, space or tab
outside comments. Lines end at ``\n`` only (a trailing ``\r`` is dropped): a form feed, U+2028
or NEL inside a comment neither ends the comment nor shifts the line numbers. The file must be a
regular file of at most ``MAX_HOSTFILE_BYTES``, and all hosts together at most ``MAX_WORLD`` slots.

Filter syntax (``-i/--include``, ``-e/--exclude``): ``host1:0,2@host2``: hosts separated by
``@``; ``host:slots`` picks slot indices; a bare host means all its slots. A host or slot named
twice counts once (``h1:1,1@h1:0`` is ``h1:0,1``, as DeepSpeed reads it). Naming a host or slot
the hostfile does not have is an error.

A *pool* is the ordered mapping ``host -> selected slot indices`` the rest of the launcher uses.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence

from dslaunch.errors import HostfileError, did_you_mean, quote
from dslaunch.utils.hostlist import hostname_problem

__all__ = ["Pool", "parse_hostfile", "read_hostfile", "parse_filter", "apply_filter", "filter_pool", "full_pool",
           "ascii_int",
           "hostname_problem", "MAX_SLOTS", "MAX_WORLD", "MAX_HOSTFILE_BYTES"]

Pool = dict[str, tuple[int, ...]]
"""host -> slot indices to use, in hostfile order."""

# A typo such as slots=80000000000 would otherwise build a pool of that many slot indices (the
# launcher hangs); no host runs more worker processes than this.
MAX_SLOTS = 4096
# Ranks of one job; 2000 hosts x 4096 slots would otherwise plan 8 million workers (MemoryError).
MAX_WORLD = 65536
# A hostfile of 65536 hosts is ~2 MB at most with long names; -H /dev/zero must not read forever.
MAX_HOSTFILE_BYTES = 4 << 20
_KEYS = ("slots",)
_LIVE_CHARS = re.compile(r"[^\t\x20-\x7e]")  # what may stand outside a comment
_FIELD_SEP = re.compile(r"[ \t]+")


def parse_hostfile(data: str | bytes, path: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text (or its raw bytes, UTF-8) into ``{host: slots}`` in file order.

    Raises:
        HostfileError: naming ``path`` and the line of the first mistake.
    """
    hosts: dict[str, int] = {}
    first: dict[str, tuple[str, int]] = {}  # lower-cased name -> (spelling, line)
    total = 0
    raw_lines = data.split(b"\n") if isinstance(data, bytes) else data.split("\n")
    for lineno, raw in enumerate(raw_lines, start=1):
        text = _decode(raw, path, lineno) if isinstance(raw, bytes) else raw
        line = text.removesuffix("\r").split("#", 1)[0]
        if bad := _LIVE_CHARS.search(line):
            raise HostfileError(f"unexpected character U+{ord(bad[0]):04X} at column {bad.start() + 1}; "
                                "outside comments a line holds printable ASCII, with spaces or tabs "
                                "between fields", path, lineno)
        line = line.strip(" \t")
        if not line:
            continue
        host, slots = _parse_line(line, path, lineno)
        if host.lower() in first:
            spelling, where = first[host.lower()]
            same = "" if spelling == host else f" (as {spelling!r}: host names are case-insensitive)"
            raise HostfileError(f"duplicate host {host!r}{same} (first listed on line {where})", path, lineno)
        total += slots
        if total > MAX_WORLD:
            raise HostfileError(f"the hosts up to this line have {total} slots; dslaunch runs at most "
                                f"{MAX_WORLD} ranks in one job", path, lineno)
        hosts[host], first[host.lower()] = slots, (host, lineno)
    if not hosts:
        raise HostfileError("no hosts listed (expected lines like 'worker-1 slots=4')", path)
    return hosts


def _decode(raw: bytes, path: str, lineno: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise HostfileError(f"invalid UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1})",
                            path, lineno) from None


def _parse_line(line: str, path: str, lineno: int) -> tuple[str, int]:
    host, *fields = _FIELD_SEP.split(line)
    if "=" in host:
        raise HostfileError(f"line starts with {quote(host)}; expected a hostname first, e.g. 'worker-1 slots=4'",
                            path, lineno)
    if problem := hostname_problem(host):
        raise HostfileError(f"invalid hostname {quote(host)}: {problem}", path, lineno)
    slots: int | None = None
    for f in fields:
        key, eq, value = f.partition("=")
        if not eq:
            raise HostfileError(f"unexpected {quote(f)} after host {host!r}; expected 'slots=N'", path, lineno)
        if key not in _KEYS:
            raise HostfileError(f"unknown key {quote(key)}{did_you_mean(key[:60], _KEYS)}; only 'slots=N' is valid",
                                path, lineno)
        if slots is not None:
            raise HostfileError(f"'slots' given twice for host {host!r}", path, lineno)
        slots = _positive_int(value, path, lineno)
    if slots is None:
        raise HostfileError(f"host {host!r} has no 'slots=N'", path, lineno)
    return host, slots


def _positive_int(value: str, path: str, lineno: int) -> int:
    n = ascii_int(value)
    if n is None:
        raise HostfileError(f"slots={quote(value)} is not an integer (digits 0-9 only)", path, lineno)
    if n <= 0:
        raise HostfileError(f"slots={n} must be a positive integer", path, lineno)
    if n > MAX_SLOTS:
        raise HostfileError(f"slots={n} is too large (at most {MAX_SLOTS} workers per host)", path, lineno)
    return n


_INT_RE = re.compile(r"-?[0-9]{1,18}")


def ascii_int(text: str) -> int | None:
    """``text`` as an int if it is plain ASCII digits (an optional '-'), else None.

    Python's ``int()`` also accepts '1_0', '+3', ' 3 ' and non-ASCII digits such as '３': none of
    them is a slot count or index a user meant, and other tools reading the same hostfile would
    reject them. The 18-digit cap keeps absurd values out of ``int()``'s own digit limit.
    """
    return int(text) if _INT_RE.fullmatch(text) else None


def read_hostfile(path: str, explicit: bool) -> dict[str, int] | None:
    """Read and parse ``path``. A missing file is None when ``explicit`` is False (= localhost).

    Only a regular file is read, at most ``MAX_HOSTFILE_BYTES`` of it: ``-H /dev/zero`` or a FIFO
    is an error, not an endless read or a silent wait for a writer.

    Raises:
        HostfileError: the file is explicitly given but missing/unreadable, or invalid.
    """
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before open(): opening a FIFO blocks
            raise HostfileError(_NOT_REGULAR, path)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        if not explicit:
            return None
        raise HostfileError("hostfile not found (given with -H/--hostfile)", path) from None
    except OSError as err:
        raise HostfileError(f"cannot read hostfile: {err.strerror}", path) from None
    try:
        data = _read_regular(fd, path)
    finally:
        os.close(fd)
    return parse_hostfile(data, path)


_NOT_REGULAR = "not a regular file; a hostfile is a text file of 'host slots=N' lines"


def _read_regular(fd: int, path: str) -> bytes:
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced between stat() and open()
        raise HostfileError(_NOT_REGULAR, path)
    chunks: list[bytes] = []
    size = 0
    try:
        while size <= MAX_HOSTFILE_BYTES and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    except OSError as err:
        raise HostfileError(f"cannot read hostfile: {err.strerror}", path) from None
    if size > MAX_HOSTFILE_BYTES:
        raise HostfileError(f"larger than {MAX_HOSTFILE_BYTES >> 20} MiB; a hostfile lists at most "
                            f"{MAX_WORLD} hosts", path)
    return b"".join(chunks)


def full_pool(hosts: Mapping[str, int]) -> Pool:
    """Every slot of every host."""
    return {h: tuple(range(n)) for h, n in hosts.items()}


def parse_filter(expr: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """Parse ``host1:0,2@host2`` into ``{host: slots or None (= all)}``.

    A host named twice gets the union of its slots (a bare mention: all of them); a repeated slot
    counts once. Hosts keep the spelling of their first mention (names are case-insensitive).

    Raises:
        HostfileError: malformed expression (names ``flag``).
    """
    out: dict[str, tuple[int, ...] | None] = {}
    where = f"{flag} {quote(expr)}"
    for part in expr.split("@"):
        host, colon, slots = part.strip().partition(":")
        if not host:
            raise HostfileError(f"{where}: empty host name (syntax: host1:0,2@host2)")
        if problem := hostname_problem(host):
            raise HostfileError(f"{where}: invalid hostname {quote(host)}: {problem}")
        host = next((h for h in out if h.lower() == host.lower()), host)
        numbers = [ascii_int(s) for s in slots.split(",")] if colon else []
        if None in numbers:
            raise HostfileError(f"{where}: slots of {host!r} must be integers, got {quote(slots)}")
        if not colon or (host in out and out[host] is None):
            out[host] = None
        else:
            out[host] = tuple(dict.fromkeys([*(out.get(host) or ()), *(n for n in numbers if n is not None)]))
    return out


def apply_filter(hosts: Mapping[str, int], include: str = "", exclude: str = "") -> Pool:
    """The pool left after ``--include`` or ``--exclude`` (they are mutually exclusive).

    Host names match case-insensitively; the pool keeps the hostfile's spelling.

    Raises:
        HostfileError: both given, malformed, an unknown host or slot, or nothing left.
    """
    result = filter_pool(full_pool(hosts), include, exclude)
    if not result:
        raise HostfileError(f"{'--include' if include else '--exclude'} {quote(include or exclude)} "
                            "leaves no slots to run on")
    return result


def filter_pool(pool: Mapping[str, Sequence[int]], include: str = "", exclude: str = "") -> Pool:
    """``pool`` narrowed by ``include`` or ``exclude``; empty when everything is excluded.

    Raises:
        HostfileError: both given, malformed, or an unknown host or slot.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    pool = {h: tuple(s) for h, s in pool.items()}
    if not include and not exclude:
        return pool
    flag = "--include" if include else "--exclude"
    spelling = {h.lower(): h for h in pool}
    chosen: dict[str, tuple[int, ...] | None] = {}
    for host, slots in parse_filter(include or exclude, flag).items():
        if host.lower() not in spelling:
            listed = ", ".join(list(pool)[:8]) + (f" and {len(pool) - 8} more" if len(pool) > 8 else "")
            raise HostfileError(f"{flag}: unknown host {host!r}{did_you_mean(host, pool)}; hosts: {listed}")
        host = spelling[host.lower()]
        bad = [s for s in slots or () if s not in pool[host]]
        if bad:
            raise HostfileError(f"{flag}: host {host!r} has slots {_slot_range(pool[host])}, not {bad[0]}")
        chosen[host] = slots
    if include:
        return {h: (tuple(sorted(chosen[h])) if chosen[h] is not None else pool[h]) for h in pool if h in chosen}
    result = {}
    for h, slots in pool.items():
        dropped = chosen.get(h, ())
        if dropped is None:  # a bare host: all of its slots are excluded
            continue
        if left := tuple(s for s in slots if s not in dropped):
            result[h] = left
    return result


def _slot_range(slots: tuple[int, ...]) -> str:
    """``0-3`` for a host's usual slots, else the list (a pool already filtered: ``0,2``)."""
    if slots and slots == tuple(range(len(slots))):
        return f"0-{len(slots) - 1}"
    return ",".join(map(str, slots)) or "none"
