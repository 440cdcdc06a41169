"""A free TCP port on this host, for single-host rendezvous, tests and benchmarks.

Shared by the launcher and the runtime (the runtime never imports the launcher). Torch-free.

The port comes from below the kernel's ephemeral range (``ip_local_port_range``): a port the
kernel numbers itself (any client socket, each of gloo's listening sockets) is never one of those,
so between the choice and the rendezvous' bind only another explicit choice can take it. A port
from the kernel's own pick (``bind(0)``) can be handed to the next ephemeral socket of any process
at once; under a busy test suite that lost a rendezvous to ``EADDRINUSE``.

``DSLAUNCH_PORT_RANGE=LOW-HIGH`` draws from ``[LOW, HIGH)`` instead: a site's open port range, or
disjoint ranges for processes that pick ports at once (the test suite gives each pytest worker its
own, so two workers never draw the same port between a draw and its bind).
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

__all__ = ["free_port", "PORT_RANGE_ENV"]

PORT_RANGE_ENV = "DSLAUNCH_PORT_RANGE"

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_BELOW = 12_000  # how many ports under the ephemeral range to draw from
_TRIES = 64


def _ephemeral_start() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _draw_range() -> tuple[int, int]:
    """``[low, high)``: ``$DSLAUNCH_PORT_RANGE``, else the ports just below the ephemeral range.

    Raises:
        ValueError: a ``DSLAUNCH_PORT_RANGE`` that is not ``LOW-HIGH`` with 1024 <= LOW < HIGH <= 65536.
    """
    given = os.environ.get(PORT_RANGE_ENV)
    if not given:
        start = _ephemeral_start()
        return max(1024, start - _BELOW), start
    try:
        low, high = (int(v) for v in given.split("-"))
    except ValueError:
        low = high = 0
    if not 1024 <= low < high <= 65536:
        raise ValueError(f"{PORT_RANGE_ENV}: expected LOW-HIGH with 1024 <= LOW < HIGH <= 65536, got {given!r}")
    return low, high


def free_port() -> int:
    """A TCP port that was free on every address of this host a moment ago, drawn at random from
    below the ephemeral range or from ``$DSLAUNCH_PORT_RANGE`` (see the module docstring); the
    kernel's pick if none of a few draws is free."""
    low, start = _draw_range()
    draws = random.SystemRandom()  # no shared generator: each call draws afresh
    for _ in range(_TRIES if start > low else 0):
        port = draws.randrange(low, start)
        if _bindable(port):
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
