"""Checkpoint on request: what a rank does when its job is about to be pre-empted.

Under ``--launcher slurm`` with ``--resume_from DIR`` the launcher sets ``CHECKPOINT_ON_REQUEST``
(``dslaunch.utils.restart``). ``arm()`` (from ``init_distributed``) then makes
``CHECKPOINT_SIGNAL`` set a flag instead of killing the process, and the heartbeat tells the node
agent that this rank takes the signal. When SLURM warns the job before its time limit or a
pre-emption (``sbatch --signal=B:USR1@120``), dslaunch asks every node agent, and each agent
signals its ranks.

A signal reaches the ranks at different moments, so they agree before acting: at the end of every
optimizer step the engine calls ``agreed()``, one 1-element all-reduce (MAX) of the flag; when any
rank saw the request, every rank saves the same step's checkpoint into DIR
(``engine.save_checkpoint``) and leaves with ``PREEMPTED_EXIT_CODE``. The requeued job's
``initialize()`` resumes from DIR (``SLURM_RESTART_COUNT`` counts as a restart).

Limitations: only steps of the engine are checked (a custom loop that never calls
``engine.step()`` keeps running until the time limit); the all-reduce costs one small collective
per step while armed.

collective: ``agreed`` on all ranks.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from dslaunch.utils.beat import CHECKPOINT_SIGNAL
from dslaunch.utils.restart import CHECKPOINT_ON_REQUEST, RESUME_FROM

__all__ = ["arm", "armed_signal", "checkpoint_dir", "requested", "agreed"]

_request = threading.Event()  # set from the signal handler; an Event is safe to set there
_armed = threading.Event()


def checkpoint_dir() -> str | None:
    """Where a requested checkpoint goes, when requests are armed for this job (else None)."""
    return os.environ.get(RESUME_FROM) or None if os.environ.get(CHECKPOINT_ON_REQUEST) == "1" else None


def arm() -> None:
    """Take ``CHECKPOINT_SIGNAL`` as a checkpoint request, when this job is armed. Idempotent;
    only from the main thread (Python's rule for signal handlers)."""
    if _armed.is_set() or checkpoint_dir() is None or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(CHECKPOINT_SIGNAL, lambda _signum, _frame: _request.set())
    _armed.set()


def armed_signal() -> int | None:
    """The signal this process takes as a request (for its heartbeats), None when not armed."""
    return int(CHECKPOINT_SIGNAL) if _armed.is_set() else None


def requested() -> bool:
    """This rank got a request (it may not be acted on yet: see ``agreed``)."""
    return _request.is_set()


def agreed(device: Any) -> bool:
    """Did any rank get a request? One all-reduce (MAX) of the flag on ``device`` (a torch device).

    collective: all ranks.
    """
    if not _armed.is_set():
        return False
    import torch  # here: the heartbeat reads this module's state without importing torch
    import torch.distributed as dist

    from dslaunch.runtime import heartbeat  # here: it imports this module
    from dslaunch.runtime.comm import comm

    flag = torch.tensor([1 if _request.is_set() else 0], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        with heartbeat.waiting("all_reduce of checkpoint requests"):
            comm.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
