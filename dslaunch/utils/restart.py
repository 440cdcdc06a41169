"""The restart contract between the launcher and a restarted worker: variable names and readers.

Every worker sees how many times its job was restarted, under torchrun's name and dslaunch's
(``TORCHELASTIC_RESTART_COUNT``, ``DSLAUNCH_RESTART_COUNT``: 0 in the first run), the restart
budget (``TORCHELASTIC_MAX_RESTARTS``), and, when the job was launched with ``--resume_from DIR``,
that directory (``DSLAUNCH_RESUME_FROM``): ``initialize()`` of a restarted run loads the newest
valid checkpoint in it, and the job's id (``DSLAUNCH_JOB_ID``, the same in every run). A restarted run also gets why (``DSLAUNCH_RESTART_REASON``: the job
monitor's one line, e.g. ``restart 1 of 3 in 1 s after hang: rank 1 on node2 hung at step 7 ...``),
which the engine's monitors mark where the curve continues. Shared by the launcher (which sets them) and the runtime (which reads
them), so the runtime never imports the launcher. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dslaunch.errors import shorten

__all__ = ["RESTART_COUNT", "TORCH_RESTART_COUNT", "TORCH_MAX_RESTARTS", "RESUME_FROM", "CHECKPOINT_ON_REQUEST",
           "RESTART_REASON", "JOB_ID", "RENDEZVOUS_ID", "REASON_LIMIT", "PREEMPTED_EXIT_CODE", "MAX_RESTARTS", "restart_env",
           "restart_count", "restart_reason", "resume_dir"]

RESTART_COUNT = "DSLAUNCH_RESTART_COUNT"
TORCH_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCH_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RESUME_FROM = "DSLAUNCH_RESUME_FROM"
RESTART_REASON = "DSLAUNCH_RESTART_REASON"
JOB_ID = "DSLAUNCH_JOB_ID"
"""The job's id, the same in every run of it (names the job's in-memory checkpoints)."""
RENDEZVOUS_ID = "DSLAUNCH_RENDEZVOUS_ID"
"""``<job id>/<run>`` where one controller planned every node (not ``--no_ssh``, where each node's
controller names the job itself): the ranks check that their rendezvous store is this run's."""
REASON_LIMIT = 300
"""The most characters of a restart reason a worker is given (it may quote a rank's exception)."""
CHECKPOINT_ON_REQUEST = "DSLAUNCH_CHECKPOINT_ON_REQUEST"
"""Set (to 1) when the launcher may ask the ranks for a checkpoint into ``RESUME_FROM`` (SLURM
pre-emption): the engine then takes ``CHECKPOINT_SIGNAL``, agrees on it at every step, saves
there and leaves with ``PREEMPTED_EXIT_CODE``."""
PREEMPTED_EXIT_CODE = 75
"""A rank that saved a checkpoint on request and stopped: EX_TEMPFAIL, "try again later"."""
MAX_RESTARTS = 1_000_000
"""The largest restart budget (``--max_restarts`` and ``monitor.max_restarts``): far beyond any
real job."""


def restart_env(count: int, max_restarts: int, resume_from: str | None, on_request: bool = False,
                reason: str | None = None, job: str = "", every_node: bool = False) -> dict[str, str]:
    """The variables the launcher gives every worker of run ``count`` (0 = the first run);
    ``on_request``: the launcher may ask for a checkpoint into ``resume_from``; ``reason``: why
    this run is a restart (one line, cut to ``REASON_LIMIT`` characters); ``job``: the job's id,
    the same in every run; ``every_node``: this controller started every node (``RENDEZVOUS_ID``)."""
    env = {RESTART_COUNT: str(count), TORCH_RESTART_COUNT: str(count), TORCH_MAX_RESTARTS: str(max_restarts)}
    if job:
        env[JOB_ID] = job
        if every_node:
            env[RENDEZVOUS_ID] = f"{job}/{count}"
    if reason and count > 0:
        env[RESTART_REASON] = shorten(reason, REASON_LIMIT)
    if resume_from:
        env[RESUME_FROM] = resume_from
        if on_request:
            env[CHECKPOINT_ON_REQUEST] = "1"
    return env


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted (0 in the first run, or when not launched by dslaunch)."""
    value = (os.environ if env is None else env).get(RESTART_COUNT, "0")
    return int(value) if value.isdigit() else 0


def restart_reason(env: Mapping[str, str] | None = None) -> str | None:
    """Why this run is a restart, as the launcher said it (None: a first run, or not said)."""
    env = os.environ if env is None else env
    return (env.get(RESTART_REASON) or None) if restart_count(env) > 0 else None


def resume_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The ``--resume_from`` directory when this run is a restart, else None."""
    env = os.environ if env is None else env
    return (env.get(RESUME_FROM) or None) if restart_count(env) > 0 else None
