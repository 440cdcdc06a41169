"""The shared gang loop (monitor.gang.Gang) with scripted node handles: the policy every runner gets."""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from dslaunch.launcher.agent.node import Agent
from dslaunch.launcher.monitor.gang import Gang, NodeHandle
from dslaunch.launcher.runners.local import _InProcessNode
from dslaunch.launcher.spec import NodeResult, NodeSpec, WorkerSpec
from tests.launcher.helpers import FAKE

pytestmark = pytest.mark.timeout(30)


class ScriptedNode(NodeHandle):
    """Finishes with ``code`` after ``after`` seconds; when stopped, finishes ``stop_delay`` later
    (None = ignores stop, only kill() ends it)."""

    def __init__(self, rank: int, wake: threading.Event, after: float | None, code: int = 0,
                 stop_delay: float | None = 0.05) -> None:
        self.node = NodeSpec(rank, f"host{rank}", ())
        self.rank, self.wake, self.code, self.stop_delay = rank, wake, code, stop_delay
        self.t0 = time.monotonic()
        self.done_at = None if after is None else self.t0 + after
        self.stopped_with: int | None = None
        self.killed = False

    def poll(self) -> NodeResult | None:
        if self.done_at is None or time.monotonic() < self.done_at:
            return None
        if self.killed:
            return NodeResult(self.rank, self.node.host, 137, stopped_by="SIGKILL")
        if self.stopped_with is not None:
            return NodeResult(self.rank, self.node.host, 128 + self.stopped_with, stopped_by="SIGTERM")
        rank = self.rank if self.code else None
        return NodeResult(self.rank, self.node.host, self.code, rank=rank)

    def stop(self, sig: int) -> None:
        self.stopped_with = sig
        if self.stop_delay is not None:
            self.done_at = time.monotonic() + self.stop_delay
            threading.Timer(self.stop_delay, self.wake.set).start()

    def kill(self) -> None:
        self.killed = True
        self.done_at = time.monotonic()
        self.wake.set()


def _gang(specs, grace=0.5):
    wake = threading.Event()
    nodes = [ScriptedNode(i, wake, *spec) for i, spec in enumerate(specs)]
    return Gang(nodes, wake, grace), nodes


def test_all_succeed():
    gang, _ = _gang([(0.05,), (0.1,)])
    r = gang.run()
    assert (r.exit_code, r.failure) == (0, None)


def test_first_failure_stops_every_other_node_and_is_the_result():
    gang, nodes = _gang([(None,), (0.1, 5), (0.3, 7), (None,)])
    r = gang.run()
    assert r.exit_code == 5 and r.failure.host == "host1"
    assert [n.stopped_with for n in nodes] == [signal.SIGTERM, None, signal.SIGTERM, signal.SIGTERM]


def test_node_ignoring_stop_is_killed_after_grace():
    gang, nodes = _gang([(None, 0, None), (0.05, 3)], grace=0.3)
    t0 = time.monotonic()
    r = gang.run()
    assert r.exit_code == 3 and nodes[0].killed
    assert 0.3 < time.monotonic() - t0 < 2.0


def test_stop_from_outside_gives_128_plus_signal():
    gang, nodes = _gang([(None,), (None,)])
    threading.Timer(0.1, gang.stop, args=(signal.SIGINT,)).start()
    r = gang.run()
    assert (r.exit_code, r.stopped_by, r.failure) == (130, "SIGINT", None)
    assert [n.stopped_with for n in nodes] == [signal.SIGINT, signal.SIGINT]


def test_node_that_never_finishes_is_given_up_after_kill(monkeypatch):
    import dslaunch.launcher.monitor.gang as gang_module

    monkeypatch.setattr(gang_module, "_GIVE_UP", 0.3)
    gang, nodes = _gang([(None, 0, None), (0.05, 2)], grace=0.1)
    nodes[0].kill = lambda: None  # a host that cannot even be killed (network gone)
    r = gang.run()
    assert r.exit_code == 2 and r.failure.host == "host1"


# -- with real in-process agents ---------------------------------------------------------------

def _agent_node(rank: int, actions: tuple[str, ...], grace: float) -> NodeSpec:
    workers = tuple(WorkerSpec(2 * rank + i, i, (sys.executable, FAKE, *actions), {"RANK": str(2 * rank + i)})
                    for i in range(2))
    return NodeSpec(rank, f"host{rank}", workers, grace=grace)


def test_failure_stops_other_nodes_while_the_failed_node_is_still_stopping():
    """SIGTERM-ignoring workers on the failed node AND on another node: one grace period, not two.

    The failed node's agent reports its failure at once (``failing``), so the other node is told
    to stop while the failed node is still waiting out its own grace period.
    """
    grace = 2.5  # one grace period plus a busy machine's delays (up to ~2 s at load 10) stays below two
    wake = threading.Event()
    failed_at: list[float] = []

    def on_change() -> None:  # called first when the failing node's worker fails
        if not failed_at and failing.failure is not None:
            failed_at.append(time.monotonic())
        wake.set()

    failing = Agent(_agent_node(0, ("ignore_term", "r1:sleep=0.3", "r1:exit=3", "hang"), grace),
                    on_change=on_change)
    other = Agent(_agent_node(1, ("ignore_term", "hang"), grace), on_change=wake.set)
    for agent in (failing, other):
        agent.start()
    try:
        r = Gang([_InProcessNode(failing), _InProcessNode(other)], wake, grace).run()
        took = time.monotonic() - failed_at[0]
    finally:
        for agent in (failing, other):
            agent.stop(signal.SIGKILL)
            agent.wait(timeout=5)
    assert (r.exit_code, r.failure.rank, r.failure.host) == (3, 1, "host0")
    assert other.poll().stopped_by == "SIGTERM"
    assert grace * 0.9 < took < grace * 2 - 0.5, f"stopping took {took:.2f} s for a grace period of {grace} s"


class _SilentNode(ScriptedNode):
    """A remote node whose agent sent its last line ``quiet`` seconds before the loop started."""

    def __init__(self, rank: int, wake: threading.Event, quiet: float) -> None:
        super().__init__(rank, wake, None)
        self.heard = time.monotonic() - quiet

    def last_heard(self) -> float:
        return self.heard


def test_a_node_silent_past_the_limit_is_a_lost_host_torn_down_at_once():
    from dslaunch.launcher.monitor.gang import HOST_SILENT_S

    wake = threading.Event()
    talking, silent = _SilentNode(0, wake, 0.0), _SilentNode(1, wake, HOST_SILENT_S - 0.5)
    talking.heard = float("inf")  # keeps talking
    result = Gang([talking, silent], wake, 0.2).run()
    assert silent.killed and talking.stopped_with == signal.SIGTERM
    f = result.failure
    assert (f.cause, f.host, f.exit_code, f.rank) == ("host_lost", "host1", 255, None)
    assert f.describe().startswith("lost host host1 (no news from its agent for 5.") and f.failed_at < time.time() - 4


def test_a_node_that_never_goes_silent_is_not_judged():
    wake = threading.Event()
    gang = Gang([ScriptedNode(0, wake, 0.3)], wake, 0.2)  # last_heard() None: an in-process agent
    assert gang.run().exit_code == 0
