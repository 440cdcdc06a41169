"""A free TCP port on this host, for single-host rendezvous, tests and benchmarks.

Shared by the launcher and the runtime (the runtime never imports the launcher). Torch-free.
"""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for single-host rendezvous, tests, benches)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
