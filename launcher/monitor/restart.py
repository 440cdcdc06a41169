"""The restart policy: after a job's run ended, restart it, or stop and say why.

A pure function (``decide``) over frozen records, so every rule is a table test:

- a finished run (exit 0) is never restarted; neither is a run the user stopped (Ctrl-C,
  SIGTERM, SIGHUP): the user's word wins over any budget;
- infrastructure failures are restarted: a signal (SIGKILL, SIGSEGV, ...), a hang, a lost host,
  a restarted run that could not start (each try uses one restart);
  so are a first exception or non-zero exit, which may be transient (a peer's reset connection);
- the same failure (cause, exception text or exit code) at the same step in two runs in a row is
  the script's bug: restarting would fail the same way, so stop and show it (the texts compared
  without addresses, ports and pids: ``failures.normalise``);
- ``--max_restarts N`` bounds the restarts; when spent, the job exits with the last failure's code;
- with ``--elastic_training``, lost hosts (any node of the run with cause ``host_lost``, root
  cause or not) are left out of the next run as long as at least ``--min_elastic_nodes`` remain;
  without it, the next run uses the same hosts;
- restart ``k`` (1-based) waits ``backoff * 2**(k-1)`` seconds, at most ``max_backoff``: a short
  first wait keeps a one-off fault's recovery within seconds, doubling keeps a flapping host from
  busy-looping.

Causes come from whoever detected the failure (``NodeResult.cause``); without one they are
derived from the exit code, signal and exception (``cause_of``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dslaunch.errors import UsageError
from dslaunch.launcher.monitor.failures import normalise
from dslaunch.launcher.spec import NodeResult

__all__ = ["RestartPolicy", "Run", "Decision", "decide", "cause_of", "describe_failure", "INFRA_CAUSES",
           "LOST_SSH"]

INFRA_CAUSES = ("signal", "hang", "host_lost", "start")
"""Causes that say nothing about the script: always worth a restart while the budget lasts (a
restarted run that cannot start, e.g. a host refusing SSH, may start at the next try)."""
LOST_SSH = "lost SSH connection"
"""``NodeResult.stopped_by`` of a node whose connection dropped (the SSH runner's words)."""


@dataclass(frozen=True)
class RestartPolicy:
    """What the launch flags ask for after a failure."""

    max_restarts: int = 0
    """``--max_restarts``: restarts allowed after the first run (0 = never restart)."""
    backoff: float = 1.0
    """Seconds before the first restart; doubles at each further restart."""
    max_backoff: float = 8.0
    elastic: bool = False
    """``--elastic_training``: a lost host is dropped and the job goes on with the rest."""
    min_nodes: int = 1
    """``--min_elastic_nodes``: the fewest nodes an elastic job runs on."""
    max_nodes: int = 0
    """``--max_elastic_nodes``: the most nodes an elastic job runs on (0 = all in the hostfile)."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise UsageError(f"--max_restarts {self.max_restarts}: expected 0 or more")
        if self.elastic and self.min_nodes < 1:
            raise UsageError(f"--min_elastic_nodes {self.min_nodes}: expected 1 or more")
        if self.elastic and self.max_nodes and self.max_nodes < self.min_nodes:
            raise UsageError(f"--max_elastic_nodes {self.max_nodes} is below --min_elastic_nodes "
                             f"{self.min_nodes}; expected max >= min")

    def describe(self) -> str:
        """One line for ``--dry-run``."""
        if self.max_restarts == 0:
            text = "restarts: none (--max_restarts 0): the first failure ends the job"
        else:
            text = (f"restarts: up to {self.max_restarts}, after {self.backoff:g} s doubling to at most "
                    f"{self.max_backoff:g} s; the same failure at the same step twice stops the job")
        if self.elastic:
            most = self.max_nodes or "all"
            text += f"; elastic: {self.min_nodes} to {most} nodes, a lost host is left out"
        return text


@dataclass(frozen=True)
class Run:
    """How one run of the job ended (the gang's result, with the hosts it ran on)."""

    exit_code: int
    hosts: tuple[str, ...]
    failure: NodeResult | None = None
    stopped_by: str | None = None
    """Signal name when the user stopped the job."""
    lost: tuple[str, ...] = ()
    """Hosts lost during the run (any node's cause ``host_lost``), root cause or not: killing a
    host also fails its peers, whose failure may be reported first."""


@dataclass(frozen=True)
class Decision:
    """What to do next: ``restart`` (after ``delay`` seconds, without ``drop``) or ``stop``."""

    action: str
    reason: str
    delay: float = 0.0
    drop: tuple[str, ...] = ()
    """Hosts to leave out of the next run (elastic only)."""
    script_bug: bool = False

    @property
    def restart(self) -> bool:
        return self.action == "restart"


def cause_of(r: NodeResult) -> str:
    """The failure's cause: the detector's, else derived (an exception beats its teardown signal)."""
    if r.cause:
        return r.cause
    if r.rank is None and r.stopped_by == LOST_SSH:
        return "host_lost"
    if r.exception:
        return "exception"
    return "signal" if r.signal_name else "exit"


def _signature(r: NodeResult) -> tuple[str, str, int | None]:
    """What must repeat for a failure to count as the script's: what happened, and at which step."""
    cause = cause_of(r)
    what = normalise(r.exception or "") if cause == "exception" else str(r.exit_code)
    return cause, what, r.step


def describe_failure(r: NodeResult) -> str:
    """``signal: rank 1 on node1 was killed by SIGKILL (exit code 137)`` (the step, when known, is
    in the description)."""
    return f"{cause_of(r)}: {r.describe()}"


def decide(policy: RestartPolicy, runs: Sequence[Run]) -> Decision:
    """Restart or stop after ``runs[-1]`` ended (``runs``: every run so far, oldest first)."""
    last = runs[-1]
    if last.exit_code == 0:
        return Decision("stop", "finished")
    if last.stopped_by is not None:
        return Decision("stop", f"stopped by {last.stopped_by}: a stop from the user is never restarted")
    f = last.failure
    if f is None:  # a failure nobody could attribute (e.g. a node that vanished while stopping)
        f = NodeResult(-1, "?", last.exit_code)
    cause = cause_of(f)
    lost = tuple(dict.fromkeys((*last.lost, *((f.host,) if cause == "host_lost" else ()))))
    prev = runs[-2].failure if len(runs) > 1 else None
    if not lost and cause not in INFRA_CAUSES and prev is not None and _signature(prev) == _signature(f):
        at = f" at step {f.step}" if f.step is not None else ""
        return Decision("stop", f"the same {cause}{at} in two runs in a row: a bug in the script, "
                                "not restarted", script_bug=True)
    done = len(runs) - 1
    if done >= policy.max_restarts:
        return Decision("stop", f"restart budget spent ({done} of {policy.max_restarts})"
                        if policy.max_restarts else "no restarts (--max_restarts 0)")
    drop: tuple[str, ...] = ()
    if lost and policy.elastic:  # (not elastic: the same hosts; the preflight tells if they answer)
        left = len([h for h in last.hosts if h not in lost])
        if left < policy.min_nodes:
            return Decision("stop", f"lost host(s) {', '.join(lost)}: {left} node(s) left, fewer than "
                                    f"--min_elastic_nodes {policy.min_nodes}")
        drop = lost
    delay = min(policy.max_backoff, policy.backoff * 2 ** done)
    without = f"; without lost host(s) {', '.join(drop)}" if drop else ""
    return Decision("restart", f"restart {done + 1} of {policy.max_restarts} in {delay:g} s after "
                               f"{describe_failure(f)}{without}", delay=delay, drop=drop)
