"""Run a function on N gloo ranks inside one test: ``run_world(fn, world_size, *args)``.

Ranks are forked from a forkserver that imported torch once, so a 4-rank test costs
milliseconds to start instead of four torch imports; each rank still gets a fresh process and
its own process group. ``fn(rank, world_size, *args)`` must be a module-level function; its
return value (picklable) comes back in a list ordered by rank. A rank that raises fails the
test with that rank's traceback, one that exits without reporting with its exit code; a rank that
hangs is killed at ``timeout``.

``@one_rank`` runs a test in such a process of its own (a world of one): what an engine leaves
behind (its process group, ``MASTER_PORT``, exit hooks) stays out of the pytest worker.

``run_python(code, env)`` runs ``code`` as ``python -c code`` would in a new interpreter with
environment ``env``, forked from the same forkserver: a test of what a new process does (a kernel
build, a cache check) without paying a torch import and an interpreter shutdown per process.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from queue import Empty
from typing import Any

from dslaunch.utils.ports import free_port

_CTX = mp.get_context("forkserver")
# numpy and pytest too (every test module imports them), not dslaunch: a test may patch
# torch.distributed before the engine's modules bind its collectives (test_engine's counter does).
# torch._dynamo: torch.optim.Optimizer's methods import it on first call (~1.5 s a rank quiet, 5-10 s
# under load), so every rank that builds an optimizer paid it again.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
_CTX.set_forkserver_preload([*PRELOAD, "numpy", "pytest"])


def preload(modules: list[str]) -> None:
    """Import ``modules`` in the forkserver too (before the first ``run_world``): a script that
    starts hundreds of worlds pays for their import once."""
    _CTX.set_forkserver_preload([*PRELOAD, *modules])


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, args: tuple, queue: Any) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    try:
        # by value: the queue's pickler would share a tensor's storage through a file descriptor
        # that this process serves until the parent takes it, and the rank may exit first (under
        # load: FileNotFoundError or ConnectionRefusedError in the parent's get)
        result = pickle.dumps(fn(rank, world, *args))
        queue.put((rank, True, result))
    except BaseException:  # report everything, including assertion errors, to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 90.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    The function decides whether to call ``init_process_group`` (env:// with MASTER_ADDR/PORT,
    RANK and WORLD_SIZE already set), so the code under test can do it itself.
    """
    port = free_port()
    queue = _CTX.Queue()
    procs = [_CTX.Process(target=_entry, args=(fn, r, world_size, port, args, queue), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    failures = ["interrupted"]  # until _collect returns: stop the ranks below
    try:
        results, failures = _collect(procs, queue, timeout)
    finally:
        for p in procs:
            p.join(timeout=0 if failures else 10)
            if p.is_alive():
                p.kill()
                p.join()
    if failures:
        raise AssertionError("\n".join(failures))
    return [results[r] for r in range(world_size)]


def one_rank(test: Callable[..., None]) -> Callable[..., None]:
    """Run ``test`` in a fresh process of its own (a world of one, as ``run_world``): an engine it
    builds leaves no process group, ``MASTER_PORT``, exit hook or heartbeat in the test worker, where
    they would reach later tests and the processes they start. Arguments must pickle (``tmp_path``
    does, ``monkeypatch`` does not)."""

    @functools.wraps(test)
    def in_own_process(*args: Any, **kwargs: Any) -> None:
        run_world(_run_test, 1, test.__module__, test.__qualname__, args, kwargs)

    return in_own_process


def _run_test(rank: int, world: int, module: str, name: str, args: tuple, kwargs: dict) -> None:
    getattr(importlib.import_module(module), name).__wrapped__(*args, **kwargs)


def _collect(procs: list[Any], queue: Any, timeout: float) -> tuple[dict[int, Any], list[str]]:
    """Each rank's report, by rank; stops at the first failure, at ranks that exited without
    reporting (a crash, or an ``fn`` the rank could not unpickle: seen within ~2 s, not at
    ``timeout``) or at ``timeout`` (a hang)."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    dead_before: set[int] = set()
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
        except Empty:
            dead = {r for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
            # a rank flushes its report before it exits: dead at the last poll too and still silent
            if dead and dead <= dead_before:
                codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in sorted(dead))
                return results, [f"ranks {sorted(dead)} exited without reporting (exit codes {codes})"]
            dead_before = dead
            if time.monotonic() >= deadline:
                return results, [f"ranks {sorted(set(range(len(procs))) - set(results))} did not finish "
                                 f"within {timeout}s (Empty)"]
            continue
        if not ok:
            return results, [f"rank {rank} failed:\n{payload}"]  # peers would block in collectives: stopped
        results[rank] = pickle.loads(payload)
    return results, []


def _python_entry(code: str, env: dict[str, str], umask: int | None, out: str, err: str) -> None:
    """A new interpreter's view: only ``env``, TMPDIR read again, stdout and stderr (also of the
    processes it starts) into files."""
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # cached by an import in the forkserver; a new interpreter reads TMPDIR
    if umask is not None:
        os.umask(umask)
    for fd, path in ((1, out), (2, err)):
        with open(path, "wb") as f:
            os.dup2(f.fileno(), fd)
    code_out = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code_out = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code_out = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code_out)


def run_python(code: str, env: dict[str, str], *, umask: int | None = None, copies: int = 1,
               timeout: float = 300.0) -> list[subprocess.CompletedProcess]:
    """``copies`` processes at once, each running ``code`` as ``python -c`` with environment ``env``
    (and ``umask``) would; each one's exit code, stdout and stderr, in start order."""
    with tempfile.TemporaryDirectory(prefix="dslaunch-run-python-") as folder:
        files = [(os.path.join(folder, f"{i}.out"), os.path.join(folder, f"{i}.err")) for i in range(copies)]
        procs = [_CTX.Process(target=_python_entry, args=(code, dict(env), umask, out, err)) for out, err in files]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        assert not hung, f"{len(hung)} of {copies} processes running {code[:60]!r}... did not end within {timeout}s"
        return [subprocess.CompletedProcess(["python", "-c", code], p.exitcode, _text(out), _text(err))
                for p, (out, err) in zip(procs, files, strict=True)]


def _text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()
