"""The job loop: run, and after a failure ask the restart policy, re-plan and run again.

``JobLoop.run()`` drives one runner per run: ``plan(attempt)`` builds the run's ``JobSpec``
(restart count, fresh master port, hosts left out), ``new_runner(job)`` gives the transport,
the gang loop watches it, and ``restart.decide`` says what next. Events (``restart`` with its
reason, ``membership`` when the hosts change, ``resume``) go to the job's event log, which every
run's runner writes to as well (the CLI's log echoes them as lines on stderr: ``print_event``).

Hosts an elastic job lost are left out of the next run and offered back at every later restart:
that run is started with them, and if the start fails naming only them (the SSH preflight), it
is started again without them.

A restarted run that cannot start (a host refusing SSH, an agent that fails to start) is a
failed run of cause ``start``: it uses one restart from the budget; hosts the error names count
as lost (an elastic job leaves them out). When the policy stops there, the start's own error is
raised, so the job exits with its code and message. The first run's start failure is raised at
once: it is a mistake to fix, not a fault to ride out.

A stop from the user (``stop(sig)``, signal-handler safe) ends the current run and never
restarts; it also cuts a backoff wait short.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from dslaunch.errors import LaunchError
from dslaunch.launcher.monitor.events import EventLog
from dslaunch.launcher.monitor.gang import GangResult
from dslaunch.launcher.monitor.restart import Decision, RestartPolicy, Run, cause_of, decide
from dslaunch.launcher.spec import HOST_LOST_EXIT_CODE, JobSpec, NodeResult

__all__ = ["Attempt", "JobLoop", "JobOutcome", "print_event"]


@dataclass(frozen=True)
class Attempt:
    """What the planner needs to know about the run it plans."""

    restart_count: int = 0
    """0 for the first run, k for the k-th restart."""
    drop: frozenset[str] = frozenset()
    """Hosts to leave out (lost hosts of an elastic job)."""
    reason: str | None = None
    """Why this run is a restart (the policy's decision, e.g. ``restart 1 of 3 in 1 s after hang:
    ...``), told to the workers; None for the first run."""


@dataclass(frozen=True)
class JobOutcome:
    """How the whole job ended: the last run's result and the policy's last word."""

    exit_code: int
    result: GangResult
    decision: Decision
    runs: tuple[Run, ...] = field(default=())


class JobLoop:
    """Runs a job until it finishes, is stopped, or the restart policy gives up.

    Args:
        policy: the restart policy.
        plan: builds the ``JobSpec`` for an attempt (raises DslaunchError on bad input).
        new_runner: a fresh runner for a job (``runners.get_runner(job.launcher)()``).
        events: the job's event log: the loop's events, and every run's runner writes there too.
        sleep: waits between runs (tests pass a recorder).
    """

    def __init__(self, policy: RestartPolicy, plan: Callable[[Attempt], JobSpec],
                 new_runner: Callable[[JobSpec], object], events: EventLog,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._policy, self._plan, self._new_runner = policy, plan, new_runner
        self._events, self._sleep = events, sleep
        self._start_error: LaunchError | None = None
        self._runner = None
        self._requested: int | None = None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the job (signal-handler safe: sets a flag and forwards to the running runner)."""
        if self._requested is None:
            self._requested = sig
        if self._runner is not None:
            self._runner.stop(sig)

    def run(self) -> JobOutcome:
        runs: list[Run] = []
        drop: frozenset[str] = frozenset()  # lost in the last run: left out of the next
        offered: frozenset[str] = frozenset()  # lost before: offered back, left out if they fail to start
        reason: str | None = None  # the last decision's, for the run it restarts
        while True:
            count = len(runs)
            result, job, left_out = self._one_run(Attempt(count, drop, reason), offered, runs)
            lost = tuple(n.host for n in result.nodes if n.exit_code and cause_of(n) == "host_lost")
            runs.append(Run(result.exit_code, job.hosts, result.failure, result.stopped_by, lost))
            decision = decide(self._policy, runs)
            if self._requested is not None and decision.restart:
                decision = Decision("stop", f"stopped by {signal.Signals(self._requested).name} "
                                            "before the restart")
            if not decision.restart:
                if self._start_error is not None and self._requested is None:
                    raise self._start_error  # its own message and exit code (the restarts were said)
                return JobOutcome(result.exit_code, result, decision, tuple(runs))
            self._events.emit("restart", reason=decision.reason, restart=count + 1, delay=decision.delay,
                       cause=None if result.failure is None else cause_of(result.failure),
                       exit_code=result.exit_code, lost=list(lost))
            drop, offered = frozenset(decision.drop), (left_out | drop) - set(decision.drop)
            reason = decision.reason
            self._wait(decision.delay)
            if self._requested is not None:
                return JobOutcome(result.exit_code, result,
                                  Decision("stop", f"stopped by {signal.Signals(self._requested).name} "
                                                   "during the restart wait"), tuple(runs))

    def _one_run(self, attempt: Attempt, offered: frozenset[str],
                 runs: list[Run]) -> tuple[GangResult, JobSpec, frozenset[str]]:
        """Plan, start and watch one run. Hosts in ``offered`` (lost in an earlier run) are planned
        back in; if the start fails naming only such hosts, the run starts again without them.
        Returns the result, the job that ran and the hosts left out of it."""
        job = self._plan(attempt)
        runner = self._new_runner(job)
        left_out = attempt.drop
        try:
            try:
                self._start(runner, job, runs)
            except LaunchError as err:
                failed = frozenset(getattr(err, "failures", {}))
                if not failed or not failed <= offered:
                    raise
                left_out = attempt.drop | failed
                job = self._plan(Attempt(attempt.restart_count, left_out, attempt.reason))
                runner = self._new_runner(job)
                self._start(runner, job, runs)
        except LaunchError as err:
            self._runner = None
            if not runs:
                raise
            self._start_error = err
            return _start_failure(err, job), job, left_out
        self._start_error = None
        code = runner.wait()
        self._runner = None
        return runner.result or GangResult(code), job, left_out

    def _start(self, runner, job: JobSpec, runs: list[Run]) -> None:
        self._runner = runner
        runner.start(job, self._events)
        if self._requested is not None:  # a signal that arrived while nodes were starting
            runner.stop(self._requested)
        previous = runs[-1].hosts if runs else None
        if previous is not None and previous != job.hosts:  # said once the new hosts did start
            self._events.emit("membership", hosts=list(job.hosts), previous=list(previous),
                       world_size=job.world_size, left=sorted(set(previous) - set(job.hosts)),
                       joined=sorted(set(job.hosts) - set(previous)))
        if runs:
            self._events.emit("resume", restart=len(runs), hosts=list(job.hosts), world_size=job.world_size,
                       master_port=job.master_port)

    def _wait(self, seconds: float) -> None:
        """The backoff, in slices, so that a stop from the user cuts it short."""
        end = time.monotonic() + seconds
        while self._requested is None and (left := end - time.monotonic()) > 0:
            self._sleep(min(0.1, left))


def _start_failure(err: LaunchError, job: JobSpec) -> GangResult:
    """A run that could not start, as the policy sees it: a ``start`` failure, and every host the
    error names (an SSH preflight's) lost."""
    failures = getattr(err, "failures", {})
    message = str(err).splitlines()[0] if len(failures) <= 1 else f"{len(failures)} hosts failed: " + "; ".join(
        f"{h}: {m}" for h, (_c, m) in sorted(failures.items()))
    host = ", ".join(sorted(failures)) or getattr(err, "host", None) or ", ".join(job.hosts)
    root = NodeResult(-1, host, err.exit_code, cause="start", message=message, failed_at=time.time())
    lost = tuple(NodeResult(-1, h, HOST_LOST_EXIT_CODE, cause="host_lost", stopped_by=m)
                 for h, (_c, m) in sorted(failures.items()))
    return GangResult(err.exit_code, root, nodes=lost or (root,))


def print_event(event: dict, log_level: str = "info") -> None:
    """The CLI's event log echo: one line on stderr per event that changes what the user sees, when
    ``log_level`` (``--log_level``) shows it: a restart's reason and host changes are warnings, a
    restart that started a note."""
    from dslaunch.launcher.log_level import say

    kind, fields = event["kind"], event
    level = "warning"
    if kind == "restart":
        line = f"dslaunch: {fields['reason']}"
    elif kind == "membership":
        line = (f"dslaunch: hosts now {', '.join(map(str, fields['hosts']))} (world size "
                f"{fields['world_size']}; left: {', '.join(map(str, fields['left'])) or '-'}, joined: "
                f"{', '.join(map(str, fields['joined'])) or '-'})")
    elif kind == "resume":
        line = (f"dslaunch: restart {fields['restart']} started on {len(fields['hosts'])} host(s), world size "
                f"{fields['world_size']}, master port {fields['master_port']}")
        level = "info"
    else:
        return
    say(log_level, level, line)
