"""Host names (``hostname_problem``) and SLURM hostlists: ``n[01-04,07],gpu-a[1-2]`` <->
``["n01", ..., "gpu-a2"]`` (``expand``, ``compress``).

Shared by the launcher (hostfiles, ``--launcher slurm``) and the runtime (the master of a job
started by ``srun`` directly), so it lives here, importing neither.

The syntax ``scontrol show hostnames`` reads: names separated by commas; each name may hold
bracketed lists of numbers and ranges (``[1-3,7]``), the width of a range's first number is the
zero padding of all of it (``[08-10]`` is 08, 09, 10), and several brackets in one name expand as
their product, leftmost slowest (``r[1-2]n[1-2]``: r1n1, r1n2, r2n1, r2n2). As in SLURM (22.05),
no text may follow the last bracket (``n[1-2]-ib`` is refused by ``scontrol`` too).

``compress`` is the inverse that keeps order: ``expand(compress(hosts)) == hosts`` for any list of
distinct names, merging only neighbours that share the text before a trailing number, and never
longer than the names joined by commas.
"""

from __future__ import annotations

import ipaddress
import itertools
import re

from dslaunch.errors import HostfileError, quote

__all__ = ["expand", "compress", "hostname_problem", "MAX_HOSTS"]

MAX_HOSTS = 65536  # no allocation is larger; a typo like n[1-99999999] must not build a list that big

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_LAST_NUMBER = re.compile(r"^(.*?)(\d+)$")
_LABEL_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?")


def hostname_problem(name: str) -> str | None:
    """Why ``name`` is not a host name (RFC 1123 labels, '_' allowed as in ssh aliases) or an IP
    address; None when it is one.

    At most 253 characters, labels of at most 63 letters, digits, '-' and '_' that neither start
    nor end with '-' (so no name reads as a command-line option); IPv6 literals may be bracketed.
    """
    if not name:
        return "empty host name"
    if len(name) > 253:
        return f"{len(name)} characters long (host names have at most 253)"
    if ":" in name:
        try:
            ipaddress.IPv6Address(name[1:-1] if name[0] == "[" and name[-1] == "]" else name)
            return None
        except ValueError:
            return "not an IPv6 address (':' is only valid in one)"
    for label in name.removesuffix(".").split("."):
        if len(label) > 63:
            return f"label {quote(label, 20)} is {len(label)} characters long (at most 63)"
        if not _LABEL_RE.fullmatch(label):
            return ("expected labels of letters, digits, '-' and '_' separated by '.', not starting or "
                    "ending with '-'")
    return None


def expand(hostlist: str, source: str = "hostlist") -> list[str]:
    """Host names of ``hostlist``, in order; ``source`` names where it came from in errors.

    Raises:
        HostfileError: unbalanced brackets, an empty name or range, a range that runs backwards,
            or more than ``MAX_HOSTS`` names.
    """
    hosts: list[str] = []
    for name in _split_top(hostlist, source):
        parts = _parts(name, source)
        count = 1
        for choices in parts:
            count *= len(choices)
        if len(hosts) + count > MAX_HOSTS:
            raise HostfileError(f"{quote(hostlist)} names more than {MAX_HOSTS} hosts", source)
        hosts.extend("".join(combo) for combo in itertools.product(*parts))
    for host in hosts:
        problem = hostname_problem(host)
        if problem:
            raise HostfileError(f"{quote(host)} from {quote(hostlist)}: {problem}", source)
    return hosts


def _split_top(hostlist: str, source: str) -> list[str]:
    """Split at commas outside brackets."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostfileError(f"nested '[' at character {i + 1} of {quote(hostlist)}", source)
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostfileError(f"']' without '[' at character {i + 1} of {quote(hostlist)}", source)
        elif ch == "," and depth == 0:
            names.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise HostfileError(f"'[' without ']' in {quote(hostlist)}", source)
    names.append(hostlist[start:])
    for name in names:
        if not name.strip():
            raise HostfileError(f"empty host name in {quote(hostlist)} (names are separated by single commas)",
                                source)
    return [n.strip() for n in names]


def _parts(name: str, source: str) -> list[list[str]]:
    """``a[1-2]b`` -> [["a"], ["1", "2"], ["b"]]: the choices of each piece, in order."""
    parts: list[list[str]] = []
    pos = 0
    for m in re.finditer(r"\[([^\]]*)\]", name):
        if m.start() > pos:
            parts.append([name[pos:m.start()]])
        if not m.group(1).strip():
            raise HostfileError(f"empty brackets in {quote(name)}", source)
        parts.append(_numbers(m.group(1), name, source))
        pos = m.end()
    if pos < len(name):
        if pos:
            raise HostfileError(f"{quote(name[pos:])} after ']' in {quote(name)}: SLURM hostlists have text "
                                "only before and between brackets", source)
        parts.append([name])
    return parts


def _numbers(bracket: str, name: str, source: str) -> list[str]:
    out: list[str] = []
    for item in bracket.split(","):
        m = _RANGE.fullmatch(item.strip())
        if not m:
            raise HostfileError(f"{quote(item)} in {quote(name)} is not a number or a range like 1-4 "
                                "(zero-padded like 01-04 for padded names)", source)
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise HostfileError(f"range {quote(item)} in {quote(name)} runs backwards", source)
        if hi - lo >= MAX_HOSTS:
            raise HostfileError(f"range {quote(item)} in {quote(name)} names more than {MAX_HOSTS} hosts", source)
        out.extend(str(n).zfill(len(lo_text)) for n in range(lo, hi + 1))
    return out


def compress(hosts: list[str]) -> str:
    """The shortest hostlist this module writes for ``hosts``, order kept (see the module doc)."""
    groups: list[tuple[str, list[list[str]]]] = []  # (prefix, ranges of number strings)
    for host in hosts:
        m = _LAST_NUMBER.match(host)
        if m is None or "[" in host or "," in host:
            groups.append((host, []))
            continue
        prefix, number = m.groups()
        last = groups[-1] if groups else None
        if last and last[1] and last[0] == prefix and int(number) > int(last[1][-1][-1]):
            ranges = last[1]
            lo = ranges[-1][0]
            if int(number) == int(ranges[-1][-1]) + 1 and number == str(int(number)).zfill(len(lo)):
                ranges[-1].append(number)
            else:
                ranges.append([number])
        else:
            groups.append((prefix, [[number]]))
    return ",".join(_write(prefix, ranges) for prefix, ranges in groups)


def _write(prefix: str, ranges: list[list[str]]) -> str:
    if not ranges:
        return prefix
    plain = ",".join(prefix + number for numbers in ranges for number in numbers)
    items = [r[0] if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in ranges]
    bracketed = f"{prefix}[{','.join(items)}]"
    return plain if len(plain) <= len(bracketed) else bracketed
