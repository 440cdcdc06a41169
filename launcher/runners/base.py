"""The runner interface and the ONE gang loop every runner shares.

A runner (local, ssh, ...) only knows how to start a node agent on a host and talk to it; it
returns one ``NodeHandle`` per node. ``Gang`` then applies the job-wide policy the same way for
every transport: the first node that reports a failure is the root cause (reported as soon as
its first worker fails, while that node is still stopping its other workers); every other node is
told to stop at once (its agent sends SIGTERM, then SIGKILL after the grace period) and is
force-killed if it is not gone shortly after; the job exits with the failed rank's exit code.

Implementing a runner::

    class MyRunner(Runner):
        name = "my"
        def _start_nodes(self, job, wake): ...   # -> list[NodeHandle]; call wake.set() on news
        def dry_run(self, job): ...               # -> text: what would run where
"""

from __future__ import annotations

import re
import shlex
import signal
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from dslaunch.launcher.spec import JobSpec, NodeResult, NodeSpec

__all__ = ["NodeHandle", "Gang", "GangResult", "Runner", "format_node"]

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


@dataclass(frozen=True)
class GangResult:
    """How the job ended."""

    exit_code: int
    failure: NodeResult | None = None
    """The first node failure (root cause), if any."""
    stopped_by: str | None = None
    """Signal name when the job was stopped from outside (Ctrl-C, SIGTERM)."""


class Gang:
    """Watches all nodes of a job; first failure anywhere stops everything.

    ``run()`` blocks in the calling thread; ``stop(sig)`` may be called from a signal handler
    (it only sets a flag).
    """

    def __init__(self, handles: list[NodeHandle], wake: threading.Event, grace: float) -> None:
        self._handles = handles
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
        while True:
            for i, h in enumerate(self._handles):
                if i in results:
                    continue
                r = h.poll()
                if r is not None:
                    results[i] = r
                if failure is None and self._requested is None:
                    if r is None:
                        r = h.failing()  # the early report: stop the others without waiting for it
                    if r is not None and r.exit_code != 0:
                        failure, failed = r, i
            if len(results) == len(self._handles):
                break
            if stopping_since is None and (failure is not None or self._requested is not None):
                stopping_since = time.monotonic()
                sig = self._requested if failure is None else signal.SIGTERM
                for i, h in enumerate(self._handles):
                    if i not in results and i != failed:
                        h.stop(sig)
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
        if failed is not None and results.get(failed, failure).rank == failure.rank:
            # The same failure, reported once the node drained its output: it names the exception.
            failure = results[failed]
        return self._result(failure, list(results.values()))

    def _result(self, failure: NodeResult | None, results: list[NodeResult]) -> GangResult:
        if failure is not None:
            return GangResult(failure.exit_code, failure)
        if self._requested is not None and any(r.exit_code for r in results):
            return GangResult(128 + self._requested, stopped_by=signal.Signals(self._requested).name)
        bad = next((r for r in results if r.exit_code), None)  # e.g. a node failing while stopping
        return GangResult(bad.exit_code, bad) if bad else GangResult(0)


class Runner(ABC):
    """Starts a job's node agents through one transport and runs the shared gang loop.

    Usage: ``runner.start(job); code = runner.wait()``; ``runner.stop()`` from a signal handler.
    """

    name: str = ""

    def __init__(self) -> None:
        self._gang: Gang | None = None
        self.result: GangResult | None = None

    def start(self, job: JobSpec) -> None:
        """Start every node. Raises LaunchError when a node cannot be started (others stopped)."""
        wake = threading.Event()
        handles = self._start_nodes(job, wake)
        grace = max((n.grace for n in job.nodes), default=0.0)
        self._gang = Gang(handles, wake, grace)

    def wait(self) -> int:
        """Block until the job ends; return its exit code (the failed rank's, or 0)."""
        assert self._gang is not None, "start() first"
        self.result = self._gang.run()
        return self.result.exit_code

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the whole job (signal-handler safe)."""
        if self._gang is not None:
            self._gang.stop(sig)

    @abstractmethod
    def _start_nodes(self, job: JobSpec, wake: threading.Event) -> list[NodeHandle]:
        """Start one agent per node; handles must ``wake.set()`` whenever they may have news."""

    @abstractmethod
    def dry_run(self, job: JobSpec) -> str:
        """What would be started on each host (commands and environment), as text."""


def format_node(node: NodeSpec) -> str:
    """Human-readable description of one node's workers, for ``--dry-run``."""
    pin = ", each pinned to an equal share of the cores" if node.bind_cores else ""
    lines = [f"# node {node.node_rank}: {node.host} ({len(node.workers)} workers{pin})"]
    if node.cwd:
        lines.append(f"cd {shlex.quote(node.cwd)}")
    for w in node.workers:
        lines.append(_shell_command([*sorted(node.env.items()), *sorted(w.env.items())], w.argv))
    return "\n".join(lines)


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _shell_command(env: list[tuple[str, str]], argv: tuple[str, ...]) -> str:
    """``K=V ... argv``, quoted so that a shell runs exactly that; a name a shell cannot assign
    (``NCCL;id``, from the environment) goes through ``env 'NAME=V'`` instead of running code."""
    plain = [f"{k}={shlex.quote(v)}" for k, v in env if _SHELL_NAME.fullmatch(k)]
    odd = [shlex.quote(f"{k}={v}") for k, v in env if not _SHELL_NAME.fullmatch(k)]
    return " ".join([*plain, *(["env", *odd] if odd else []), shlex.join(argv)])
