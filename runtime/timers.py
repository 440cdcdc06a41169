"""Named wall-clock timers for ``wall_clock_breakdown`` (forward, backward, allreduce, step).

Owns timing only: the engine starts and stops named timers around its phases and, every
``steps_per_print`` steps, logs one line such as
``time (ms) | forward: 12.31 | backward: 20.02 | allreduce: 8.47 | step: 4.10``.

GPU work is asynchronous, so a timer synchronises CUDA before reading the clock, but only when
CUDA is actually in use in this process (never initialises it; no cost on CPU-only runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

__all__ = ["Timer", "Timers", "STEP_TIMERS", "SynchronizedWallClockTimer", "NoopTimer"]

#: The phases the engine times, in log order.
STEP_TIMERS = ("forward", "backward", "allreduce", "step")


def _sync_cuda_if_in_use() -> None:
    import sys

    torch = sys.modules.get("torch")  # never import torch just to time something
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """One named timer accumulating the time between ``start()`` and ``stop()`` calls.

    Args:
        name: shown in logs and errors.
        sync: called before each clock reading (CUDA synchronisation by default).
        clock: seconds as a float (``time.perf_counter`` by default; injectable for tests).
    """

    def __init__(self, name: str, sync: Callable[[], None] = _sync_cuda_if_in_use,
                 clock: Callable[[], float] = time.perf_counter):
        self.name = name
        self._sync, self._clock = sync, clock
        self._elapsed = 0.0
        self._started_at: float | None = None
        self.count = 0  # completed start/stop intervals since the last reset
        self.total = 0.0  # seconds over every completed interval, never reset (deltas for monitors)

    @property
    def running(self) -> bool:
        return self._started_at is not None

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError(f"timer {self.name!r} is already running")
        self._sync()
        self._started_at = self._clock()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError(f"timer {self.name!r} is not running")
        self._sync()
        interval = self._clock() - self._started_at
        self._elapsed += interval
        self.total += interval
        self._started_at = None
        self.count += 1

    def reset(self) -> None:
        self._elapsed, self._started_at, self.count = 0.0, None, 0

    def elapsed(self, reset: bool = True) -> float:
        """Accumulated seconds (a running timer includes its current interval and keeps running).

        Args:
            reset: clear the accumulated time afterwards (a running timer restarts its interval).
        """
        total = self._elapsed
        if self._started_at is not None:
            self._sync()
            now = self._clock()
            total += now - self._started_at
            if reset:
                self._started_at = now
        if reset:
            self._elapsed, self.count = 0.0, 0
        return total

    def mean(self) -> float:
        """Mean seconds per completed interval (0 when there was none); does not reset."""
        return self._elapsed / self.count if self.count else 0.0


class Timers:
    """A group of named timers, created on first use: ``timers("forward").start()``.

    Args:
        sync: passed to each timer (default: synchronise CUDA when it is in use).
        clock: passed to each timer.
    """

    def __init__(self, sync: Callable[[], None] = _sync_cuda_if_in_use,
                 clock: Callable[[], float] = time.perf_counter):
        self._sync, self._clock = sync, clock
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str) -> Timer:
        timer = self._timers.get(name)
        if timer is None:
            timer = self._timers[name] = Timer(name, self._sync, self._clock)
        return timer

    def __contains__(self, name: str) -> bool:
        return name in self._timers

    # Name-first shorthands: ``timers.start("forward")`` == ``timers("forward").start()``.
    def start(self, name: str) -> None:
        self(name).start()

    def stop(self, name: str) -> None:
        self(name).stop()

    def elapsed(self, name: str, reset: bool = True) -> float:
        """Seconds accumulated by timer ``name`` (0 for a timer never used)."""
        return self(name).elapsed(reset)

    def log_line(self, names: Iterable[str] = STEP_TIMERS, normalizer: float = 1.0, reset: bool = True) -> str:
        """One line ``time (ms) | name: ms | ...`` for the timers in ``names`` that exist.

        Args:
            names: timers to show, in order; names never started are left out.
            normalizer: divide each time by this (e.g. the number of steps since the last log).
            reset: clear the shown timers.
        """
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        parts = [f"{name}: {self._timers[name].elapsed(reset) * 1000.0 / normalizer:.2f}"
                 for name in names if name in self._timers]
        return " | ".join(["time (ms)", *parts])

    def log(self, names: Iterable[str] = STEP_TIMERS, normalizer: float = 1.0, reset: bool = True,
            print_fn: Callable[[str], None] = print) -> str:
        """Format like ``log_line`` and hand the line to ``print_fn``; returns the line.

        The caller decides which ranks print (DeepSpeed logs from rank 0 only).
        """
        line = self.log_line(names, normalizer, reset)
        print_fn(line)
        return line


class SynchronizedWallClockTimer:
    """DeepSpeed's group of named timers (``deepspeed.utils.timer``), in milliseconds.

    ``timers("fwd").start()``, ``.stop()``, ``.elapsed(reset=True)`` (ms), and ``timers.log(names)``,
    which prints ``time (ms) | fwd: 12.31 | ...`` on rank 0 (``ranks`` to choose others). The same
    timers as ``Timers`` (CUDA synchronised when in use), in DeepSpeed's units and shape.
    """

    class Timer(Timer):
        """One timer; ``elapsed`` and ``mean`` in milliseconds as DeepSpeed's."""

        def stop(self, reset: bool = False, record: bool = False) -> None:  # DeepSpeed's signature
            super().stop()

        def elapsed(self, reset: bool = True) -> float:
            return super().elapsed(reset) * 1000.0

        def mean(self) -> float:
            return super().mean() * 1000.0

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        return self.timers

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: list[int] | None = None) -> None:
        """Print the timers in ``names`` that exist, each divided by ``normalizer``, on ``ranks`` (default [0])."""
        from dslaunch.utils.logging import print_dist

        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        parts = [f"{name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
                 for name in names if name in self.timers]
        print_dist(" | ".join(["time (ms)", *parts]), ranks=ranks or [0])

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> dict[str, float]:
        """Mean milliseconds per interval of the timers in ``names`` that exist, divided by ``normalizer``."""
        if normalizer <= 0:
            raise ValueError(f"normalizer must be > 0, got {normalizer}")
        return {name: self.timers[name].mean() / normalizer for name in names if name in self.timers}


class NoopTimer:
    """DeepSpeed's timer group that times nothing (``wall_clock_breakdown`` off): same calls, no cost."""

    class Timer:
        def start(self) -> None: ...

        def stop(self, **kwargs: object) -> None: ...

        def reset(self) -> None: ...

        def elapsed(self, **kwargs: object) -> float:
            return 0

        def mean(self) -> float:
            return 0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict:
        return {}

    def log(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True,
            memory_breakdown: bool = False, ranks: list[int] | None = None) -> None: ...

    def get_mean(self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True) -> None: ...
