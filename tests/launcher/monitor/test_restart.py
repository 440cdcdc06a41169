"""The restart policy as a table: which runs are restarted, after how long, without which host."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dslaunch.errors import LaunchError, UsageError
from dslaunch.launcher.monitor.restart import RestartPolicy, Run, cause_of, decide
from dslaunch.launcher.spec import NodeResult

pytestmark = pytest.mark.timeout(10)

HOSTS = ("n1", "n2", "n3")
KILLED = NodeResult(0, "n1", 137, rank=1, signal_name="SIGKILL")
BOOM = NodeResult(0, "n1", 1, rank=0, exception="RuntimeError: boom", step=5)
BOOM_LATER = NodeResult(0, "n1", 1, rank=0, exception="RuntimeError: boom", step=9)
OTHER = NodeResult(0, "n1", 1, rank=0, exception="ValueError: other", step=5)
EXIT3 = NodeResult(0, "n1", 3, rank=0)
HUNG = NodeResult(0, "n2", 137, rank=2, cause="hang", step=5)
LOST = NodeResult(1, "n2", 255, stopped_by="lost SSH connection")


def _run(failure: NodeResult | None, code: int | None = None, stopped_by: str | None = None, hosts=HOSTS) -> Run:
    return Run(code if code is not None else (failure.exit_code if failure else 0), hosts, failure, stopped_by)


@pytest.mark.parametrize("result, cause", [
    (KILLED, "signal"), (BOOM, "exception"), (EXIT3, "exit"), (HUNG, "hang"), (LOST, "host_lost"),
    # an exception whose teardown then aborted: the exception is the cause
    (NodeResult(0, "n1", 134, rank=0, signal_name="SIGABRT", exception="RuntimeError: x"), "exception"),
    (NodeResult(0, "n1", 137, rank=0, signal_name="SIGKILL", cause="oom"), "oom"),
])
def test_cause_is_the_detectors_else_derived(result, cause):
    assert cause_of(result) == cause


P3 = RestartPolicy(max_restarts=3)


@pytest.mark.parametrize("policy, runs, action, words", [
    (P3, [_run(None)], "stop", "finished"),
    (P3, [_run(None, 130, "SIGINT")], "stop", "stopped by SIGINT: a stop from the user is never restarted"),
    (P3, [_run(KILLED), _run(None, 143, "SIGTERM")], "stop", "never restarted"),
    (RestartPolicy(), [_run(KILLED)], "stop", "no restarts (--max_restarts 0)"),
    (P3, [_run(KILLED)], "restart", "restart 1 of 3 in 1 s after signal: rank 1 on n1 was killed by SIGKILL"),
    (P3, [_run(KILLED)] * 2, "restart", "restart 2 of 3 in 2 s after signal"),  # signals repeat: infra
    (P3, [_run(KILLED)] * 3, "restart", "restart 3 of 3 in 4 s"),
    (P3, [_run(KILLED)] * 4, "stop", "restart budget spent (3 of 3)"),
    (P3, [_run(HUNG)] * 2, "restart", "after hang: rank 2 on n2 hung at step 5"),
    (P3, [_run(BOOM)], "restart", "after exception: rank 0 on n1 raised RuntimeError: boom (exit code 1)"),
    (P3, [_run(BOOM)] * 2, "stop", "the same exception at step 5 in two runs in a row: a bug in the script"),
    (P3, [_run(BOOM), _run(BOOM_LATER)], "restart", "restart 2"),  # it got further: not the same
    (P3, [_run(BOOM), _run(OTHER)], "restart", "restart 2"),
    (P3, [_run(BOOM), _run(KILLED), _run(BOOM)], "restart", "restart 3"),  # not in a row
    (P3, [_run(EXIT3)] * 2, "stop", "the same exit in two runs in a row"),
    # the same raise with an object's address in it, once exiting 1, once stopped by SIGTERM after it
    (P3, [_run(replace(BOOM, exception="RuntimeError: boom <T at 0x7f3a2b1c4d90>")),
          _run(replace(BOOM, exit_code=143, signal_name="SIGTERM", exception="RuntimeError: boom <T at 0x7f0010ab>"))],
     "stop", "the same exception at step 5 in two runs in a row"),
    (RestartPolicy(max_restarts=9, max_backoff=8), [_run(KILLED)] * 6, "restart", "restart 6 of 9 in 8 s"),
])
def test_decide(policy, runs, action, words):
    d = decide(policy, runs)
    assert d.action == action and words in d.reason, d.reason


def test_the_same_bug_twice_is_marked_as_the_scripts():
    assert decide(P3, [_run(BOOM)] * 2).script_bug and not decide(P3, [_run(KILLED)] * 2).script_bug


def test_backoff_doubles_from_one_second_and_is_capped():
    delays = [decide(RestartPolicy(max_restarts=10), [_run(KILLED)] * n).delay for n in range(1, 7)]
    assert delays == [1, 2, 4, 8, 8, 8]


ELASTIC = RestartPolicy(max_restarts=3, elastic=True, min_nodes=2)


@pytest.mark.parametrize("policy, hosts, action, drop, words", [
    (ELASTIC, HOSTS, "restart", ("n2",), "after host_lost: node n2 was stopped by lost SSH connection"),
    (ELASTIC, ("n1", "n2"), "stop", (), "lost host(s) n2: 1 node(s) left, fewer than --min_elastic_nodes 2"),
    (P3, HOSTS, "restart", (), "restart 1"),  # not elastic: the same hosts again
])
def test_a_lost_host_is_left_out_only_when_elastic_and_enough_remain(policy, hosts, action, drop, words):
    d = decide(policy, [_run(LOST, hosts=hosts)])
    assert (d.action, d.drop) == (action, drop) and words in d.reason, d.reason


def test_a_host_lost_behind_a_peers_failure_is_left_out_and_never_a_script_bug():
    peer = NodeResult(0, "n1", 1, rank=0, exception="RuntimeError: Connection reset by peer")
    runs = [Run(1, HOSTS, peer, lost=("n2",))]
    d = decide(ELASTIC, runs)
    assert d.restart and d.drop == ("n2",) and d.reason.endswith("without lost host(s) n2"), d.reason
    d = decide(RestartPolicy(max_restarts=3, elastic=True), [*runs, Run(1, ("n1", "n3"), peer, lost=("n3",))])
    assert d.restart and d.drop == ("n3",) and not d.script_bug  # same exception, but a host was lost


def test_a_killed_rank_is_not_a_lost_host():
    assert decide(ELASTIC, [_run(KILLED)]).drop == ()


@pytest.mark.parametrize("kwargs, words", [
    ({"max_restarts": -1}, "--max_restarts -1: expected 0 or more"),
    ({"elastic": True, "min_nodes": 3, "max_nodes": 2}, "--max_elastic_nodes 2 is below --min_elastic_nodes 3"),
])
def test_bad_policy_flags(kwargs, words):
    with pytest.raises(UsageError, match=words):
        RestartPolicy(**kwargs)


# ---- the job loop's membership bookkeeping, with scripted runs (the transport is not under test) ----

class _Down(LaunchError):
    def __init__(self, hosts):
        self.failures = {h: ("timeout", "no answer") for h in hosts}
        super().__init__(f"{sorted(hosts)} do not answer")


class _ScriptedRunner:
    """Plays back how each run ends; refuses to start a job with a host in ``down``, where a lost
    host goes unless it answers again (``down`` None)."""

    def __init__(self, script, down, started):
        self._script, self._down, self._started = script, down, started
        self.result = None

    def start(self, job, events=None):
        if dead := [h for h in job.hosts if h in (self._down or ())]:
            raise _Down(dead)
        self._started.append(job.hosts)

    def wait(self):
        self.result = self._script.pop(0)
        if self._down is not None:
            self._down.update(n.host for n in self.result.nodes if n is LOST)
        return self.result.exit_code

    def stop(self, sig):
        pass


def _loop_over(hosts, script, down):
    from dslaunch.launcher.monitor.events import EventLog
    from dslaunch.launcher.monitor.loop import JobLoop
    from dslaunch.launcher.spec import JobSpec, NodeSpec

    started, events = [], []

    def plan(attempt):
        nodes = tuple(NodeSpec(i, h, ()) for i, h in enumerate(h for h in hosts if h not in attempt.drop))
        return JobSpec(nodes, "x", 1, len(nodes))

    log = EventLog(None, echo=lambda e: events.append((e["kind"], e)))
    loop = JobLoop(RestartPolicy(max_restarts=3, elastic=True), plan,
                   lambda job: _ScriptedRunner(script, down, started), log, sleep=lambda s: None)
    return loop.run(), started, events


@pytest.mark.parametrize("answers_again, third_run", [(True, ("n1", "n2", "n3")), (False, ("n1", "n3"))])
def test_a_lost_host_is_left_out_then_offered_back(answers_again, third_run):
    from dslaunch.launcher.monitor.gang import GangResult

    lost = GangResult(255, LOST, nodes=(NodeResult(0, "n1", 143), LOST, NodeResult(2, "n3", 143)))
    script = [lost, GangResult(137, KILLED), GangResult(0)]
    outcome, started, events = _loop_over(HOSTS, script, down=None if answers_again else set())
    assert outcome.exit_code == 0 and outcome.decision.reason == "finished"
    assert started == [HOSTS, ("n1", "n3"), third_run]
    changes = [(f["left"], f["joined"]) for kind, f in events if kind == "membership"]
    assert changes == ([(["n2"], []), ([], ["n2"])] if answers_again else [(["n2"], [])])
