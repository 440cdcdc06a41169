"""pytest plugin loaded (``-p conformance_shim``) into the run of DeepSpeed's unit tests.

It adapts DeepSpeed's harness (``tests/unit/common.py``) to this CPU machine and records each
outcome as it happens, so a run killed mid-file still leaves every finished test on disk:

- ``DS_ACCELERATOR=cpu``: both DeepSpeed and dslaunch pick their CPU accelerator.
- ``LOCAL_SIZE``: DeepSpeed's CPU accelerator counts devices from it, and the harness skips a test
  whose world size exceeds that count. The harness sets it in each rank; the pytest process needs
  it too, or every distributed test skips for "not enough GPUs".
- ``CONFORMANCE_NO_DISTRIBUTED=1`` leaves out the harness's distributed tests (``DistributedTest``
  classes: each spawns a pool of ranks that import torch and DeepSpeed; minutes each on a loaded
  machine), so a quick run covers every other test of every file.
- A rank that raises stops its test at once (``_fail_fast``): the harness waits for every rank's
  result, and a peer of the failed rank waits in a collective for it (a test's ``dist.barrier()``)
  until the gloo timeout; the harness then stops pytest ("Test hanged") and the file's later tests
  are lost. The ranks' pool is terminated on the first exception, which the test reports.
- ``CONFORMANCE_EVENTS``: a JSON-lines file. One ``collected`` line per test, one ``file`` line when
  a file starts, one ``report`` line per finished test (its outcome and a one-line reason).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.pool
import os
import sys
import time
from typing import Any

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("LOCAL_SIZE", "4")

_events_path = os.environ.get("CONFORMANCE_EVENTS")
_current_file: list[str] = []


def _emit(**event: Any) -> None:
    if not _events_path:
        return
    with open(_events_path, "a", encoding="utf-8") as out:
        out.write(json.dumps(event) + "\n")
        out.flush()


def _reason(report: Any) -> str:
    """One line that says why a test failed or skipped (the last line of pytest's text)."""
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:300]
    lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
    error_lines = [line for line in lines if line.startswith("E ")]
    return (error_lines[-1] if error_lines else lines[-1] if lines else "")[:300]


# Last: DeepSpeed's pytest.ini deselects marks (``-m "not sequential ..."``) in the same hook; a test
# counted as collected before that would count as unfinished, a failure.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    if os.environ.get("CONFORMANCE_NO_DISTRIBUTED") == "1":
        distributed = [item for item in items if getattr(item.cls, "is_dist_test", False)]
        if distributed:
            config.hook.pytest_deselected(items=distributed)
            items[:] = [item for item in items if not getattr(item.cls, "is_dist_test", False)]
    for item in items:
        _emit(event="collected", nodeid=item.nodeid)


class _FailFastPool(multiprocessing.pool.Pool):
    """The harness's pool of ranks: ``starmap_async(...).get`` raises the first rank's exception as
    soon as it arrives and terminates the ranks still running (their peers' collectives would wait
    for the failed rank until the gloo timeout); ``starmap`` on a pool so stopped does nothing (the
    harness's teardown calls it)."""

    stopped = False

    def starmap_async(self, func: Any, iterable: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().starmap_async(func, iterable, *args, **kwargs)
        wait_all = result.get

        def get(timeout: float | None = None) -> Any:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not result.ready():
                if getattr(result, "_success", True) is False:  # a rank raised; the others may wait on it
                    self.stopped = True
                    self.terminate()
                    _forget(self)
                    raise result._value
                if deadline is not None and time.monotonic() > deadline:
                    raise multiprocessing.TimeoutError
                result.wait(0.5)
            return wait_all(0)

        result.get = get
        return result

    def starmap(self, func: Any, iterable: Any, *args: Any, **kwargs: Any) -> Any:
        return [] if self.stopped else super().starmap(func, iterable, *args, **kwargs)


def _forget(pool: Any) -> None:
    """Drop a terminated pool from the harness's cache of reused pools."""
    common = sys.modules.get("unit.common")
    cache = getattr(getattr(common, "DistributedExec", None), "_pool_cache", {})
    for size in [k for k, v in cache.items() if v is pool]:
        del cache[size]


class _Multiprocessing:
    """``torch.multiprocessing`` as the harness sees it, its ``Pool`` a ``_FailFastPool``."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Pool(self, processes: int | None = None, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (its name)
        return _FailFastPool(processes, *args, context=multiprocessing.get_context(), **kwargs)


def _fail_fast() -> None:
    common = sys.modules.get("unit.common")
    if common is not None and not isinstance(getattr(common, "mp", None), _Multiprocessing):
        common.mp = _Multiprocessing(common.mp)


def pytest_runtest_setup(item: Any) -> None:
    _fail_fast()


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _emit(event="collect_error", nodeid=report.nodeid, reason=_reason(report))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    path = nodeid.split("::", 1)[0]
    if _current_file[-1:] != [path]:
        _current_file.append(path)
        _emit(event="file", path=path)


def pytest_runtest_logreport(report: Any) -> None:
    # A test's outcome is its call phase's, or its setup's when setup failed or skipped it; a
    # teardown error turns a pass into a failure.
    if report.when == "call" or (report.when == "setup" and not report.passed):
        _emit(event="report", nodeid=report.nodeid, outcome=report.outcome, reason=_reason(report))
    elif report.when == "teardown" and report.failed:
        _emit(event="report", nodeid=report.nodeid, outcome="failed", reason="teardown: " + _reason(report))
