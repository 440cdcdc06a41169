"""Hostfiles (DeepSpeed syntax) and the ``--include``/``--exclude`` slot filter.

Hostfile syntax, one host per line::

    # comment
    worker-1 slots=4     # trailing comments too
    worker-2 slots=4

Every mistake is a ``HostfileError`` naming the file and line: duplicate host, ``slots`` missing,
zero, negative or not plain ASCII digits, unknown keys, trailing junk.

Filter syntax (``-i/--include``, ``-e/--exclude``): ``host1:0,2@host2``: hosts separated by
``@``; ``host:slots`` picks slot indices; a bare host means all its slots. Naming a host or slot
the hostfile does not have is an error (DeepSpeed silently ignores some of these).

A *pool* is the ordered mapping ``host -> selected slot indices`` the rest of the launcher uses.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from dslaunch.errors import HostfileError, did_you_mean

__all__ = ["Pool", "parse_hostfile", "read_hostfile", "parse_filter", "apply_filter", "full_pool", "ascii_int",
           "MAX_SLOTS"]

Pool = dict[str, tuple[int, ...]]
"""host -> slot indices to use, in hostfile order."""

# A typo such as slots=80000000000 would otherwise build a pool of that many slot indices (the
# launcher hangs); no host runs more worker processes than this.
MAX_SLOTS = 4096
_HOST_RE = re.compile(r"^[A-Za-z0-9_.:\[\]-]+$")
_KEYS = ("slots",)


def parse_hostfile(text: str, path: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into ``{host: slots}`` in file order.

    Raises:
        HostfileError: naming ``path`` and the line of the first mistake.
    """
    hosts: dict[str, int] = {}
    lines_of: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        host, slots = _parse_line(line, path, lineno)
        if host in hosts:
            raise HostfileError(f"duplicate host {host!r} (first listed on line {lines_of[host]})", path, lineno)
        hosts[host], lines_of[host] = slots, lineno
    if not hosts:
        raise HostfileError("no hosts listed (expected lines like 'worker-1 slots=4')", path)
    return hosts


def _parse_line(line: str, path: str, lineno: int) -> tuple[str, int]:
    host, *fields = line.split()
    if "=" in host:
        raise HostfileError(f"line starts with {host!r}; expected a hostname first, e.g. 'worker-1 slots=4'",
                            path, lineno)
    if not _HOST_RE.match(host):
        raise HostfileError(f"invalid hostname {host!r}", path, lineno)
    slots: int | None = None
    for f in fields:
        key, eq, value = f.partition("=")
        if not eq:
            raise HostfileError(f"unexpected {f!r} after host {host!r}; expected 'slots=N'", path, lineno)
        if key not in _KEYS:
            raise HostfileError(f"unknown key {key!r}{did_you_mean(key, _KEYS)}; only 'slots=N' is valid",
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
        raise HostfileError(f"slots={value!r} is not an integer (digits 0-9 only)", path, lineno)
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

    Raises:
        HostfileError: the file is explicitly given but missing/unreadable, or invalid.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        if not explicit:
            return None
        raise HostfileError("hostfile not found (given with -H/--hostfile)", path) from None
    except (OSError, UnicodeDecodeError) as err:
        raise HostfileError(f"cannot read hostfile: {err}", path) from None
    return parse_hostfile(text, path)


def full_pool(hosts: Mapping[str, int]) -> Pool:
    """Every slot of every host."""
    return {h: tuple(range(n)) for h, n in hosts.items()}


def parse_filter(expr: str, flag: str) -> dict[str, tuple[int, ...] | None]:
    """Parse ``host1:0,2@host2`` into ``{host: slots or None (= all)}``.

    Raises:
        HostfileError: malformed expression (names ``flag``).
    """
    out: dict[str, tuple[int, ...] | None] = {}
    for part in expr.split("@"):
        host, colon, slots = part.strip().partition(":")
        if not host:
            raise HostfileError(f"{flag} {expr!r}: empty host name (syntax: host1:0,2@host2)")
        if host in out:
            raise HostfileError(f"{flag} {expr!r}: host {host!r} named twice")
        if not colon:
            out[host] = None
            continue
        numbers = [ascii_int(s) for s in slots.split(",")]
        if None in numbers:
            raise HostfileError(f"{flag} {expr!r}: slots of {host!r} must be integers, got {slots!r}")
        picked = tuple(n for n in numbers if n is not None)  # all of them; the filter narrows the type
        if len(set(picked)) != len(picked):
            raise HostfileError(f"{flag} {expr!r}: slot listed twice for host {host!r}")
        out[host] = picked
    return out


def apply_filter(hosts: Mapping[str, int], include: str = "", exclude: str = "") -> Pool:
    """The pool left after ``--include`` or ``--exclude`` (they are mutually exclusive).

    Raises:
        HostfileError: both given, malformed, an unknown host or slot, or nothing left.
    """
    if include and exclude:
        raise HostfileError("--include and --exclude are mutually exclusive")
    pool = full_pool(hosts)
    if not include and not exclude:
        return pool
    flag = "--include" if include else "--exclude"
    chosen = parse_filter(include or exclude, flag)
    for host, slots in chosen.items():
        if host not in hosts:
            raise HostfileError(f"{flag}: unknown host {host!r}{did_you_mean(host, hosts)}; "
                                f"hosts: {', '.join(hosts)}")
        bad = [s for s in slots or () if not 0 <= s < hosts[host]]
        if bad:
            raise HostfileError(f"{flag}: host {host!r} has slots 0-{hosts[host] - 1}, not {bad[0]}")
    if include:
        result = {h: (tuple(sorted(chosen[h])) if chosen[h] is not None else pool[h])
                  for h in pool if h in chosen}
    else:
        result = {}
        for h, slots in pool.items():
            dropped = chosen.get(h, ())
            if dropped is None:  # a bare host: all of its slots are excluded
                continue
            if left := tuple(s for s in slots if s not in dropped):
                result[h] = left
    if not result:
        raise HostfileError(f"{flag} {include or exclude!r} leaves no slots to run on")
    return result
