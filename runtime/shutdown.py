"""Leaving cleanly at interpreter exit: every process group is freed while Python is still whole.

Why: gloo's worker threads live as long as their C++ ``ProcessGroup``. A group still alive when
the interpreter finalizes is freed during module teardown; a gloo thread that then needs the GIL
(to release a finished work's tensors) is ended by CPython with ``pthread_exit``, whose unwinding
through a ``noexcept`` C++ frame calls ``std::terminate``: "terminate called without an active
exception", SIGABRT, exit 134 after a job that finished (pytorch/pytorch#179291). How often
depends on scheduling, so it shows under load.

What kept the group alive in dslaunch jobs although ``destroy_process_group()`` had run:
``torch.distributed.nn.functional`` binds ``group=group.WORLD`` as default arguments when it is
imported, and every torch optimizer imports it (through ``torch._dynamo``, on its first
``add_param_group``), i.e. after ``init_process_group``. Those defaults held the live default
group, so destroy only unregistered it and its threads ran on into finalization. dslaunch's own
private checkpoint group, held by the engine, was the second one.

``register_clean_exit()`` (called by ``init_distributed`` and ``initialize``) installs one
``atexit`` handler per process:

- normal exit or ``sys.exit(n)``: each live engine's ``destroy()`` waits for its in-flight
  collectives and drops its checkpoint group; the process groups are destroyed; the references
  that ``torch.distributed``'s modules keep in default arguments are dropped. The C++ groups are
  freed and their threads joined now;
- uncaught exception or Ctrl-C: the same teardown, bounded in time: a peer stuck in a collective
  could block it, so after ``FAILING_EXIT_BOUND_S`` the process flushes its output and leaves
  with ``os._exit`` and the exit code Python would have used (1, or 130 for Ctrl-C);
- the script destroyed the group itself: only the references are dropped.

Then, on every path that got that far, the interpreter's own finalization is spared its full
garbage collections: with torch loaded (~170,000 tracked objects from ``import torch`` alone) they
took ~1 s of a 2-rank job's end here after the last step (2-3 s under load). One collection now runs
the finalizers of whatever is already garbage, every file still open for writing is flushed, and
everything left is frozen (``gc.freeze``): finalization then frees by reference count alone.

Limitations: a group the user's own code still references after ``destroy_process_group`` stays
alive into finalization, exactly as in plain torch. An object alive at exit whose only references
form a cycle is not finalized (Python does not promise ``__del__`` at exit either): its files are
flushed, not closed (a ``gzip`` file in such a cycle lacks its trailer); a process that needs
finalization's collections registers ``gc.unfreeze`` with ``atexit`` before calling
``initialize``/``init_distributed``. A process that loaded a nanobind extension keeps them
(nanobind reports each object it bound that was never freed): triton is one, which
``torch._dynamo`` loads wherever it is installed (every CUDA build of torch).
"""

from __future__ import annotations

import _io
import atexit
import functools
import gc
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FunctionType
from typing import Any

import torch.distributed as dist

from dslaunch.runtime import heartbeat

__all__ = ["register_clean_exit", "FAILING_EXIT_BOUND_S"]

FAILING_EXIT_BOUND_S = 5.0
"""How long an exit by exception may spend tearing the groups down before leaving anyway."""

_engines: weakref.WeakSet = weakref.WeakSet()


def register_clean_exit(engine: Any = None) -> None:
    """Make the process free its process groups at exit (after ``engine`` is quiet, if given)."""
    _install()
    if engine is not None:
        _engines.add(engine)


@functools.cache
def _install() -> None:
    atexit.register(_leave)  # once per process, however many engines


def _failure() -> BaseException | None:
    """The uncaught exception the interpreter is exiting with, if any."""
    return getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)


def _leave() -> None:
    beats = heartbeat.reporter()
    if beats is not None:
        beats.exiting()
    failure = _failure()
    if failure is None:
        _teardown()
        _spare_final_collections()
        return
    done = threading.Thread(target=_teardown, name="dslaunch-exit", daemon=True)
    done.start()
    done.join(FAILING_EXIT_BOUND_S)
    if done.is_alive():
        code = 128 + signal.SIGINT if isinstance(failure, KeyboardInterrupt) else 1
        print(f"dslaunch: the process group did not shut down within {FAILING_EXIT_BOUND_S:.0f} s "
              f"of the uncaught {type(failure).__name__} (a peer still in a collective?); "
              f"exiting with code {code}", file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    _spare_final_collections()


def _spare_final_collections() -> None:
    """Collect now, flush open files, freeze the rest (see the module docstring); not in a process
    with a nanobind extension (triton), which reports every object it bound that was never freed."""
    if _nanobind_loaded():
        return
    gc.collect()
    for obj in gc.get_objects():
        # type(), never isinstance(): the latter reads __class__, which warns on deprecated module
        # attributes. _io's C base: every file object, C or Python (gzip's too).
        if issubclass(type(obj), _io._IOBase):
            _flush(obj)
    gc.freeze()


def _nanobind_loaded() -> bool:
    """A class bound by nanobind exists (its metaclass is nanobind's): triton, imported by
    ``torch._dynamo`` (so by every torch optimizer) wherever it is installed."""
    return any(issubclass(type(obj), type) and type(obj).__module__ == "nanobind" for obj in gc.get_objects())


def _flush(file: Any) -> None:
    """What finalization would have flushed: a file frozen in a reference cycle is never closed."""
    try:
        if not file.closed and file.writable():
            file.flush()
    except Exception:  # closed under us, a broken pipe, a user's file class: what finalization would ignore
        pass


def _teardown() -> None:
    for engine in list(_engines):
        engine.destroy()  # its pending works hold gloo's transport (and its thread) alive
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _drop_default_arguments()


def _drop_default_arguments() -> None:
    """Replace process groups bound as default arguments in ``torch.distributed``'s modules by
    None (what those modules bind when imported before any group exists)."""
    for fn in _distributed_functions():
        defaults = fn.__defaults__
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            fn.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in defaults)


def _distributed_functions() -> Iterator[FunctionType]:
    """Module-level functions and class methods of the loaded ``torch.distributed`` modules."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("torch.distributed"):
            continue
        for value in list(vars(module).values()):
            # type() rather than isinstance(): the latter reads __class__, which warns on
            # deprecated module attributes (torch.distributed.reduce_op)
            members = vars(value).values() if issubclass(type(value), type) else (value,)
            yield from (m for m in members if type(m) is FunctionType)
