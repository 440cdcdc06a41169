"""Leaving cleanly at interpreter exit: finish in-flight collectives, then destroy the process group.

Why: DeepSpeed training scripts rarely call ``destroy_process_group()``. On gloo, a process that
exits with the group still alive can abort during interpreter finalization ("terminate called
without an active exception", SIGABRT), because gloo's worker threads still hold work objects
whose tensors need the GIL while Python is being torn down (pytorch/pytorch#179291, #190489).
The job then fails with exit code 134 although training finished (seen in CI here: rank 1 of a
6-rank ZeRO-2 demo run, after its last step).

``register_clean_exit(engine)`` (called by ``initialize``) registers one ``atexit`` handler per
process. On a normal exit it waits for each live engine's in-flight parameter gathers and then
destroys the default process group while the interpreter is still whole. The set of live engines
is process-wide by nature (exit is), held weakly so that the handler never keeps an engine alive.

Limitations: after an uncaught exception the handler does nothing. Waiting for collectives then
could block on a peer that is itself stuck, and a failing exit is already non-zero.
"""

from __future__ import annotations

import atexit
import functools
import sys
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["register_clean_exit"]

_engines: weakref.WeakSet = weakref.WeakSet()


def register_clean_exit(engine: Any) -> None:
    """Make the process destroy its process group at a normal exit, after ``engine`` is quiet."""
    _install()
    _engines.add(engine)


@functools.cache
def _install() -> None:
    atexit.register(_leave)  # once per process, however many engines


def _failing() -> bool:
    """True when the interpreter is exiting because of an uncaught exception."""
    return getattr(sys, "last_value", None) is not None or getattr(sys, "last_exc", None) is not None


def _leave() -> None:
    if _failing() or not (dist.is_available() and dist.is_initialized()):
        return
    for engine in list(_engines):
        engine.zero.synchronize()
    dist.destroy_process_group()
