"""The restart contract between the launcher and a restarted worker: variable names and readers.

Every worker sees how many times its job was restarted, under torchrun's name and dslaunch's
(``TORCHELASTIC_RESTART_COUNT``, ``DSLAUNCH_RESTART_COUNT``: 0 in the first run), the restart
budget (``TORCHELASTIC_MAX_RESTARTS``), and, when the job was launched with ``--resume_from DIR``,
that directory (``DSLAUNCH_RESUME_FROM``): ``initialize()`` of a restarted run loads the newest
valid checkpoint in it. Shared by the launcher (which sets them) and the runtime (which reads
them), so the runtime never imports the launcher. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RESTART_COUNT", "TORCH_RESTART_COUNT", "TORCH_MAX_RESTARTS", "RESUME_FROM", "CHECKPOINT_ON_REQUEST",
           "PREEMPTED_EXIT_CODE", "MAX_RESTARTS", "restart_env",
           "restart_count", "resume_dir"]

RESTART_COUNT = "DSLAUNCH_RESTART_COUNT"
TORCH_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
TORCH_MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RESUME_FROM = "DSLAUNCH_RESUME_FROM"
CHECKPOINT_ON_REQUEST = "DSLAUNCH_CHECKPOINT_ON_REQUEST"
"""Set (to 1) when the launcher may ask the ranks for a checkpoint into ``RESUME_FROM`` (SLURM
pre-emption): the engine then takes ``CHECKPOINT_SIGNAL``, agrees on it at every step, saves
there and leaves with ``PREEMPTED_EXIT_CODE``."""
PREEMPTED_EXIT_CODE = 75
"""A rank that saved a checkpoint on request and stopped: EX_TEMPFAIL, "try again later"."""
MAX_RESTARTS = 1_000_000
"""The largest restart budget (``--max_restarts`` and ``monitor.max_restarts``): far beyond any
real job."""


def restart_env(count: int, max_restarts: int, resume_from: str | None, on_request: bool = False) -> dict[str, str]:
    """The variables the launcher gives every worker of run ``count`` (0 = the first run);
    ``on_request``: the launcher may ask for a checkpoint into ``resume_from``."""
    env = {RESTART_COUNT: str(count), TORCH_RESTART_COUNT: str(count), TORCH_MAX_RESTARTS: str(max_restarts)}
    if resume_from:
        env[RESUME_FROM] = resume_from
        if on_request:
            env[CHECKPOINT_ON_REQUEST] = "1"
    return env


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How many times this job was restarted (0 in the first run, or when not launched by dslaunch)."""
    value = (os.environ if env is None else env).get(RESTART_COUNT, "0")
    return int(value) if value.isdigit() else 0


def resume_dir(env: Mapping[str, str] | None = None) -> str | None:
    """The ``--resume_from`` directory when this run is a restart, else None."""
    env = os.environ if env is None else env
    return (env.get(RESUME_FROM) or None) if restart_count(env) > 0 else None
