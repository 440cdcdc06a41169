"""Launch specs: what to start where, as frozen dataclasses that travel as one JSON line.

The CLI builds a ``JobSpec`` (all nodes, rendezvous address, launcher choice); runners only
consume it. Each ``NodeSpec`` is self-contained: a node agent (``dslaunch.launcher.agent``),
local or remote, needs nothing else to start that node's workers, so it is what the SSH runner
sends to a remote agent (``NodeSpec.to_json()`` on the agent's stdin).

Spec (this module) -> instance (``agent.node.Agent`` with its worker processes) -> state
(``NodeResult``: how a node ended).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["WorkerSpec", "NodeSpec", "JobSpec", "MonitorSpec", "NodeResult", "DEFAULT_GRACE", "HANG_EXIT_CODE",
           "HOST_LOST_EXIT_CODE"]

# Seconds between SIGTERM and SIGKILL when stopping workers: short enough that a failed job is
# fully stopped within 2 s even when a worker ignores SIGTERM.
DEFAULT_GRACE = 1.0
HANG_EXIT_CODE = 124
"""A job stopped because a rank made no progress for ``--hang_timeout``: timeout(1)'s code."""
HOST_LOST_EXIT_CODE = 255
"""A job stopped because a host was lost: what ssh(1) exits with when the connection drops."""


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process."""

    global_rank: int
    local_rank: int
    argv: tuple[str, ...]
    """Full command line, interpreter included (e.g. ``python -u train.py --local_rank=0``)."""
    env: dict[str, str] = field(default_factory=dict)
    """Per-worker variables (RANK, LOCAL_RANK, ...), set on top of the node's env."""


@dataclass(frozen=True)
class NodeSpec:
    """Everything one node agent needs to run that node's share of the job."""

    node_rank: int
    host: str
    workers: tuple[WorkerSpec, ...]
    env: dict[str, str] = field(default_factory=dict)
    """Variables common to the node's workers, set on top of the agent's own environment."""
    cwd: str | None = None
    """Working directory of the workers; None = the agent's."""
    log_dir: str | None = None
    """``--enable_each_rank_log``: also write each rank's output to ``<log_dir>/rank<N>.log``."""
    grace: float = DEFAULT_GRACE
    """Seconds between SIGTERM and SIGKILL when stopping workers."""
    pid_file: str | None = None
    """``--save_pid``: the agent writes its pid here while it runs and removes it at exit."""
    bind_cores: bool = False
    """``--bind_cores_to_rank``: split the cores among the node's workers, pin each worker to
    its share and set its OMP_NUM_THREADS to the share's size."""
    core_list: tuple[int, ...] = ()
    """``--bind_core_list``: the cores to split; empty = the agent's own CPU affinity."""

    def to_json(self) -> str:
        """One line of JSON (no newline inside), for an agent's stdin."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodeSpec:
        """Inverse of ``to_json``; unknown keys are ignored (newer controller, older agent)."""
        raw = json.loads(text)
        workers = tuple(
            WorkerSpec(**{**_known(WorkerSpec, w), "argv": tuple(w["argv"])}) for w in raw["workers"]
        )
        return cls(**{**_known(cls, raw), "workers": workers, "core_list": tuple(raw.get("core_list", ()))})


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}


@dataclass(frozen=True)
class MonitorSpec:
    """What the controller's monitor watches and where it writes (``--hang_timeout``, ``--log_dir``)."""

    hang_timeout: float | None = None
    """Seconds without progress on a rank before the job is declared hung; None = off."""
    log_dir: str | None = None
    """This job's directory (events.jsonl, error and stack files); None = write no files."""


@dataclass(frozen=True)
class JobSpec:
    """The whole job as the CLI resolved it. Runners read it, never the argparse namespace."""

    nodes: tuple[NodeSpec, ...]
    master_addr: str
    """The plan's rendezvous address: ``--master_addr``, else 127.0.0.1 (local) or the first host."""
    master_port: int
    world_size: int
    launcher: str = "local"
    """Registry name of the runner (``runners.RUNNERS``)."""
    launcher_args: str = ""
    """``--launcher_args``: extra arguments for the transport (e.g. ssh options), verbatim."""
    python: str = ""
    """Interpreter that runs node agents on every host (the controller's ``sys.executable``)."""
    ssh_port: int | None = None
    ssh_accept_new_host_keys: bool = False
    venv_script: str | None = None
    """``--venv_script``: a shell script each SSH host sources before its agent starts."""
    log_level: str = "info"
    """``--log_level``: which of the launcher's own lines are printed (``launcher.log_level``)."""
    hostfile: str | None = None
    """Hostfile the nodes came from (None = localhost only), for messages."""
    user_script: str | None = None
    """The script file every worker runs (None with --module/--no_python): preflight checks that
    each host has it, so a missing file is one line per host, not one Python error per rank."""
    master_given: bool = False
    """``master_addr`` is the user's ``--master_addr`` (a runner keeps it), not the plan's default."""
    ray_address: str | None = None
    """``--launcher ray``: the Ray cluster the nodes are (``--ray_address``, or ``local``)."""
    monitor: MonitorSpec = field(default_factory=MonitorSpec)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes)


STOP_SIGNALS = {"SIGTERM": 128 + 15, "SIGKILL": 128 + 9}
"""The signals that stop the other ranks after a failure, with the shell code of each."""


@dataclass(frozen=True)
class NodeResult:
    """How a node's workers ended: the first failure on that node, or success.

    ``exit_code`` follows the shell convention: a worker killed by signal N gives 128+N, never 0.
    """

    node_rank: int
    host: str
    exit_code: int
    rank: int | None = None
    """Global rank of the first failed worker (None on success or when no worker failed)."""
    signal_name: str | None = None
    """E.g. ``SIGSEGV`` when that worker died by a signal."""
    stopped_by: str | None = None
    """Signal name when the node was stopped from outside (Ctrl-C, SIGTERM, lost controller)."""
    exception: str | None = None
    """The last uncaught exception that worker printed (``Type: message``), if any."""
    cause: str | None = None
    """What kind of failure, for the restart policy: ``exit``, ``signal``, ``exception``, ``hang``,
    ``host_lost``, ``oom`` or ``start`` (a restarted run that could not start; None on success).
    Set by whoever detected the failure."""
    step: int | None = None
    """The failed rank's last reported training step (heartbeats), if known."""
    traceback: str | None = None
    """The whole traceback that worker printed, as printed (the original exception first), if any."""
    failed_at: float | None = None
    """Wall-clock time (``time.time()``) at which the failure happened or was last known good, as
    seen where it was detected (the agent: the worker's exit), for detection-time measurements."""
    message: str | None = None
    """Why the run could not start (cause ``start``): the launch error's one line; for a hang, the
    allowance that ran out (``no progress for 60 s: ...``)."""
    raised_at: float | None = None
    """When that worker raised its exception (``time.time()`` on its host, sent by the worker the
    moment it raised): the blame goes to the first rank that raised, not the first to exit."""

    @property
    def ended_by_stop_signal(self) -> bool:
        """Whether this worker ended the way the launcher stops ranks after a failure: killed by
        SIGTERM or SIGKILL, or exiting with such a signal's shell code from a handler."""
        return self.signal_name in STOP_SIGNALS or (self.signal_name is None
                                                    and self.exit_code in STOP_SIGNALS.values())

    @property
    def job_exit_code(self) -> int:
        """The job's exit code when this is its failure: 1 for a rank that raised (a torch
        ``OutOfMemoryError`` too) and was stopped while still tearing down, or aborted in that
        teardown (SIGABRT: a C++ destructor of the process group, seen at load ~19), as its uncaught
        exception would have ended it; otherwise ``exit_code`` (the kernel's OOM killer raises
        nothing: 137 stays). Which signal reached a slow teardown first is load, not the script's
        word."""
        return 1 if self.exception is not None and self._ended_in_teardown else self.exit_code

    @property
    def _ended_in_teardown(self) -> bool:
        """Ended by a stop signal or SIGABRT: how a process that is tearing down ends under load."""
        return self.ended_by_stop_signal or self.signal_name == "SIGABRT"

    def describe(self) -> str:
        """One line for the user, e.g. ``rank 3 on node1 was killed by SIGKILL (exit code 137)`` or
        ``rank 1 on node2 raised ValueError: bad batch (exit code 1)``."""
        if self.cause == "hang":
            at = f" at step {self.step}" if self.step is not None else ""
            return f"rank {self.rank} on {self.host} hung{at} ({self.message or 'no progress within --hang_timeout'})"
        # Beats are rate-limited: a killed rank may have gone a few steps past its last report.
        at = f" (last reported step {self.step})" if self.step is not None else ""
        if self.cause == "start":
            return f"the run could not start: {self.message} (exit code {self.exit_code})"
        if self.cause == "host_lost":
            how = self.stopped_by or "no news from its agent"
            return f"lost host {self.host} ({how}; exit code {self.exit_code})"
        if self.rank is None:
            if self.stopped_by:
                return f"node {self.host} was stopped by {self.stopped_by} (exit code {self.exit_code})"
            return f"node {self.host} exited with code {self.exit_code}"
        who = f"rank {self.rank} on {self.host}"
        if self.exception is None:
            how = (f"was killed by {self.signal_name} (exit code {self.exit_code})" if self.signal_name
                   else f"exited with code {self.exit_code}")
            return f"{who} {how}{at}"
        if self.signal_name is None:
            return f"{who} raised {self.exception} (exit code {self.exit_code})"
        if self._ended_in_teardown:
            # the exception ended it; which signal reached its slow teardown first is load: the
            # line starts the same either way
            return f"{who} raised {self.exception} (then {self.signal_name} in its teardown: exit code {self.exit_code})"
        return f"{who} was killed by {self.signal_name} (exit code {self.exit_code}) after raising {self.exception}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> NodeResult:
        return cls(**_known(cls, json.loads(text)))
