"""The agent as its own process (``python -m dslaunch.launcher.agent``, or after the bootstrap).

It reads one ``NodeSpec`` JSON line from stdin, runs the node, and exits with the node's exit code
after printing the status line (``wire``) on stderr; the failure line goes out as soon as a
worker fails, the beats line whenever the workers' heartbeats changed (at most every
``BEATS_EVERY_S``) and at least every ``ALIVE_EVERY_S`` (the node's own liveness), the stacks
line when the controller asked for stacks on stdin. When stdin reaches EOF (controller died, SSH
connection lost), the controller's ``ALIVE`` lines stop for ``CONTROLLER_SILENT_S`` (a cut link),
or the agent gets SIGTERM/SIGINT/SIGHUP, it stops all its workers and exits.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from dslaunch.errors import LaunchError
from dslaunch.launcher.agent.node import Agent
from dslaunch.launcher.agent.spare import SparePool
from dslaunch.launcher.agent.wire import (
    ALIVE,
    ALIVE_EVERY_S,
    BEATS_EVERY_S,
    CHECKPOINT_REQUEST,
    CONTROLLER_SILENT_S,
    STACKS_REQUEST,
    format_beats_line,
    format_failure_line,
    format_stacks_line,
    format_status_line,
)
from dslaunch.launcher.spec import NodeResult, NodeSpec

__all__ = ["main"]


def main(spares: SparePool | None = None) -> int:
    """Agent entry point: NodeSpec JSON line on stdin; exit code = the node's exit code.
    ``spares``: warm spare workers to start the workers in (ended when the node is)."""
    try:
        return _run(spares)
    finally:
        if spares is not None:
            spares.close()


def _run(spares: SparePool | None) -> int:
    line, rest = _first_line(0)
    if not line.strip():
        print("dslaunch agent: expected one NodeSpec JSON line on stdin, got EOF", file=sys.stderr)
        return 2
    node = NodeSpec.from_json(line.decode())
    news = threading.Event()
    agent = Agent(node, on_change=news.set, adopt_orphans=True, spares=spares)
    pending: list[int] = []  # the handler only records: taking locks in a signal handler can deadlock
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: pending.append(signum))
    try:
        agent.start()
    except LaunchError as err:
        print(f"dslaunch agent: {err}", file=sys.stderr)
        result = NodeResult(node.node_rank, node.host, 127)
        print(format_status_line(result), file=sys.stderr, flush=True)
        return result.exit_code
    heard: list[float] = []  # monotonic time of the controller's last ALIVE, once it sent one
    threading.Thread(target=_read_requests, args=(agent, heard, rest), daemon=True, name="stdin-requests").start()
    stopping = announced = False
    sent: dict = {}
    sent_at = 0.0
    while (result := agent.poll()) is None:
        news.wait(0.1)  # a timeout too: signals only reach ``pending``
        news.clear()
        quiet = time.monotonic() - sent_at
        if quiet >= BEATS_EVERY_S and ((beats := agent.beats()) != sent or quiet >= ALIVE_EVERY_S):
            sent, sent_at = beats, time.monotonic()
            agent.report(format_beats_line(beats))
        if not announced and (failure := agent.failure) is not None:
            announced = True  # the controller stops the other nodes now, not after our grace period
            print(format_failure_line(failure), file=sys.stderr, flush=True)
        if pending and not stopping:
            stopping = True
            agent.stop(pending[0])
        if heard and time.monotonic() - heard[-1] > CONTROLLER_SILENT_S and not stopping:
            stopping = True  # the controller is gone (a cut link, see wire): as at EOF
            agent.stop(signal.SIGTERM)
    print(format_status_line(result), file=sys.stderr, flush=True)
    return result.exit_code


def _first_line(fd: int) -> tuple[bytes, bytes]:
    """The NodeSpec line, and what came after it in the same reads (the controller's first
    requests). Raw reads: a buffered reader would keep those bytes from ``_read_requests``."""
    data = b""
    while b"\n" not in data and (chunk := os.read(fd, 65536)):
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def _read_requests(agent: Agent, heard: list[float], pending: bytes = b"") -> None:
    """The controller holds our stdin open for the whole job: EOF means it is gone; a
    ``STACKS_REQUEST`` line asks for the workers' stacks (answered from a thread of its own), a
    ``CHECKPOINT_REQUEST`` line for a checkpoint; an ``ALIVE`` line is appended to ``heard`` as
    its time (the last one is kept). ``pending``: bytes already read after the NodeSpec line."""
    while True:
        *lines, pending = pending.split(b"\n")
        requests = {line.strip() for line in lines}
        if ALIVE.encode() in requests:
            heard[:] = [time.monotonic()]
        if STACKS_REQUEST.encode() in requests:
            threading.Thread(target=lambda: agent.report(format_stacks_line(agent.dump_stacks())),
                             daemon=True, name="stacks").start()
        if CHECKPOINT_REQUEST.encode() in requests:
            agent.request_checkpoint()
        data = os.read(0, 4096)  # raw fd: a daemon thread must not hold the buffered stdin's lock
        if not data:
            break
        pending = pending[-4096:] + data
    agent.stop(signal.SIGTERM)

