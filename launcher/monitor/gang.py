"""The gang loop: watches every node of a job; the first failure anywhere stops everything.

Runners start node agents and hand over one ``NodeHandle`` per node; ``Gang`` applies the job-wide
policy the same way for every transport: the first node that reports a failure is the root cause
(reported as soon as its first worker fails, while that node is still stopping its other
workers); every other node is told to stop at once (its agent sends SIGTERM, then SIGKILL after
the grace period) and is force-killed if it is not gone shortly after; the job exits with the
failed rank's exit code.

With a ``JobMonitor`` the loop also feeds it the ranks' heartbeats on every turn; a rank that
stalls past ``--hang_timeout`` is a failure too (cause ``hang``, exit code ``HANG_EXIT_CODE``):
the monitor dumps every rank's stacks first, and the nodes of the ranks behind are killed
without a grace period (they are stuck; the others get the usual SIGTERM).

A node whose transport can go silent (a remote agent) and that sent nothing at all for
``HOST_SILENT_S`` is a lost host (cause ``host_lost``): its agent speaks at least every second
(``agent.wire.ALIVE_EVERY_S``), so silence means a frozen host or a cut link that TCP has not
noticed yet. It is torn down at once (``kill``), and the restart policy treats it like a dropped
connection.
"""

from __future__ import annotations

import signal
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from dslaunch.launcher.monitor.failures import root_cause
from dslaunch.launcher.spec import HOST_LOST_EXIT_CODE, NodeResult, NodeSpec
from dslaunch.utils.beat import Beat

if TYPE_CHECKING:
    from dslaunch.launcher.monitor.job import JobMonitor

__all__ = ["NodeHandle", "Gang", "GangResult", "HOST_SILENT_S"]

HOST_SILENT_S = 5.0
"""A remote node that sent nothing for this long is lost: 5 of its agent's 1 s liveness lines
missed (a loaded host may delay one or two; the issue's target for host loss is < 10 s)."""

# After asking nodes to stop, how long past their grace period before force-killing them.
_KILL_SLACK = 0.3
# After force-killing, how long to wait for a node to report before declaring it lost.
_GIVE_UP = 5.0


class NodeHandle(ABC):
    """The controller's view of one started node (an agent in-process, over SSH, ...)."""

    node: NodeSpec

    @abstractmethod
    def poll(self) -> NodeResult | None:
        """The node's result once it has finished, else None. Must not block."""

    @abstractmethod
    def stop(self, sig: int) -> None:
        """Ask the node to stop all its workers with ``sig`` (SIGKILL after its grace). Non-blocking."""

    @abstractmethod
    def kill(self) -> None:
        """Last resort: the node did not stop in time. Tear it down now; poll() must then finish."""

    def failing(self) -> NodeResult | None:
        """The node's first worker failure while the node is still stopping (before ``poll()``
        has its result), if the transport reports one early; None otherwise. Must not block."""
        return None

    def last_heard(self) -> float | None:
        """Monotonic time of the node's last news (any line from its agent); None where the node
        cannot go silent (an agent in this process): such a node is never judged lost."""
        return None

    def beats(self) -> Mapping[int, Beat]:
        """The latest heartbeat of each of the node's ranks that sent one. Must not block."""
        return {}

    def request_stacks(self) -> None:
        """Ask the node for every running worker's stacks (answer via ``stacks``). Non-blocking."""
        return None  # a transport without stack dumps: ``stacks`` answers {} at once

    def stacks(self) -> dict[int, dict] | None:
        """The answer to ``request_stacks`` (rank -> ``{"stopped", "stack"}``), None until it came."""
        return {}


@dataclass(frozen=True)
class GangResult:
    """How the job ended."""

    exit_code: int
    failure: NodeResult | None = None
    """The first node failure (root cause), if any."""
    stopped_by: str | None = None
    """Signal name when the job was stopped from outside (Ctrl-C, SIGTERM)."""
    detected_at: float | None = None
    """Wall-clock time the loop acted on ``failure`` (compare ``failure.failed_at``)."""
    details: str | None = None
    """What the user should read beyond ``failure.describe()``: a remedy, where stacks are."""
    nodes: tuple[NodeResult, ...] = ()
    """Every node's own result (the restart policy looks for lost hosts among them)."""


class Gang:
    """Watches all nodes of a job; first failure anywhere stops everything.

    ``run()`` blocks in the calling thread; ``stop(sig)`` may be called from a signal handler
    (it only sets a flag).
    """

    def __init__(self, handles: list[NodeHandle], wake: threading.Event, grace: float,
                 monitor: JobMonitor | None = None) -> None:
        self._handles = handles
        self._monitor = monitor
        self._wake = wake
        self._grace = grace
        self._requested: int | None = None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Request a stop; the loop acts within its 0.1 s poll. Lock-free, so signal-handler safe
        (setting the wake Event here could deadlock if the signal interrupted the loop's own wait)."""
        if self._requested is None:
            self._requested = sig

    def run(self) -> GangResult:
        results: dict[int, NodeResult] = {}
        failure: NodeResult | None = None
        failed: int | None = None  # the node that failed first: it is already stopping itself
        stopping_since: float | None = None
        killed = False
        detected_at: float | None = None
        stuck: set[int] = set()  # nodes of hung ranks: no grace period for them
        silent = False  # the failure is a node that went silent (torn down, its own result says less)
        turn = judge_from = time.monotonic()
        while True:
            # A controller that was itself frozen (swapping, stopped) heard nothing meanwhile: give
            # its readers a second to catch up before calling anyone silent.
            last, turn = turn, time.monotonic()
            if turn - last > 1.0:
                judge_from = turn + 1.0
            for i, h in enumerate(self._handles):
                if i in results:
                    continue
                r = h.poll()
                if r is not None:
                    results[i] = r
                if failure is None and self._requested is None:
                    if r is None:
                        r = h.failing()  # the early report: stop the others without waiting for it
                    if r is None and turn >= judge_from and (r := _silence(h)) is not None:
                        silent = True
                        h.kill()  # unreachable or frozen: no stop request would get through
                    if r is not None and r.exit_code != 0:
                        failure, failed, detected_at = r, i, time.time()
            if len(results) == len(self._handles):
                break
            if self._monitor is not None and failure is None and self._requested is None:
                self._monitor.observe(self._handles)
                if stalled := self._monitor.stalled():
                    failure, stuck = self._monitor.diagnose_hang(self._handles, stalled)
                    detected_at = time.time()
            if stopping_since is None and (failure is not None or self._requested is not None):
                stopping_since = time.monotonic()
                sig = self._requested if failure is None else signal.SIGTERM
                for i, h in enumerate(self._handles):
                    if i not in results and i != failed:
                        h.stop(signal.SIGKILL if i in stuck else sig)
            waited = time.monotonic() - stopping_since if stopping_since is not None else 0.0
            if not killed and waited > self._grace + _KILL_SLACK:
                killed = True
                # Not the failed node: its agent enforces the grace period itself and may still be
                # draining its workers' last output (the traceback); the give-up below bounds it.
                for i, h in enumerate(self._handles):
                    if i not in results and i != failed:
                        h.kill()
            if killed and waited > self._grace + _KILL_SLACK + _GIVE_UP:
                for i, h in enumerate(self._handles):  # unresponsive: stop waiting, say so
                    if i not in results:
                        results[i] = NodeResult(h.node.node_rank, h.node.host, 137, stopped_by="unresponsive")
                break
            self._wake.wait(0.1)
            self._wake.clear()
        if failed is not None and not silent and results.get(failed, failure).rank is not None:
            # The node's final word, once it drained its workers' output: it names the exception,
            # and the rank that raised first where the first to die only echoed it (root_cause).
            failure = results[failed]
        if failure is not None:
            failure = root_cause(failure, [r for i, r in sorted(results.items()) if i != failed and r.exit_code])
        result = self._result(failure, list(results.values()))
        result = replace(result, nodes=tuple(results[i] for i in sorted(results)))
        if self._monitor is None:
            return result
        self._monitor.observe(self._handles)  # the last beats (a dying rank flushes its last step)
        if result.failure is not None:
            result = replace(result, failure=self._monitor.complete(result.failure), detected_at=detected_at)
        details = self._monitor.finish(result, list(results.values()), detected_at)
        return replace(result, details=details)

    def _result(self, failure: NodeResult | None, results: list[NodeResult]) -> GangResult:
        if failure is not None:
            return GangResult(failure.job_exit_code, failure)
        if self._requested is not None and any(r.exit_code for r in results):
            return GangResult(128 + self._requested, stopped_by=signal.Signals(self._requested).name)
        bad = next((r for r in results if r.exit_code), None)  # e.g. a node failing while stopping
        return GangResult(bad.exit_code, bad) if bad else GangResult(0)


def _silence(h: NodeHandle) -> NodeResult | None:
    """A ``host_lost`` failure for a node silent past ``HOST_SILENT_S``, else None."""
    heard = h.last_heard()
    if heard is None or (quiet := time.monotonic() - heard) <= HOST_SILENT_S:
        return None
    return NodeResult(h.node.node_rank, h.node.host, HOST_LOST_EXIT_CODE, cause="host_lost",
                      stopped_by=f"no news from its agent for {quiet:.1f} s", failed_at=time.time() - quiet)
