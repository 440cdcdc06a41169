"""``Monitor`` (one backend) and ``MonitorMaster`` (all the enabled ones); DeepSpeed's
``deepspeed.monitor.monitor`` re-exports them.

An event is DeepSpeed's tuple ``(name, value, step)``: the engine's names are
``Train/Samples/<metric>`` and its step is the number of samples trained (``global_samples``).
A value is a number, a 0-d tensor (read on the writer thread, so the training thread never waits
for the device) or a string (TensorBoard shows it as text; the other backends record it as is).

``MonitorMaster.write_events`` only enqueues: the backends write on one background thread
(``writer.py``). As DeepSpeed's, only rank 0 writes; elsewhere the master holds no backend. What is
still queued when the interpreter exits is written then (an ``atexit`` handler, bounded in time):
a script that never closes its monitor, or whose engine was already collected, loses nothing.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterable, Sequence
from typing import Any

from dslaunch.runtime.config.monitors import DeepSpeedMonitorConfig
from dslaunch.runtime.monitors.writer import BackgroundWriter

__all__ = ["Monitor", "MonitorMaster", "Event"]

Event = tuple[str, Any, int]

EXIT_BOUND_S = 10.0
"""How long the exit may wait for the monitors to write what was queued (a hung service)."""


class Monitor:
    """One backend; ``write_events`` writes synchronously (``MonitorMaster`` calls it off the
    training thread)."""

    def __init__(self, config: Any):
        self.config = config
        self.enabled = bool(getattr(config, "enabled", True))

    def start_at(self, samples: int) -> None:
        """The run continues from ``samples``: what an earlier attempt logged past it is dropped.

        Called before the first event of a run (fresh: 0, resumed: the checkpoint's samples).
        """

    def write_events(self, event_list: Sequence[Event]) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Hand what was written to the operating system (a SIGKILL after this loses nothing)."""

    def close(self) -> None:
        self.flush()


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _backends(config: DeepSpeedMonitorConfig) -> list[Monitor]:
    """The enabled backends, each imported only when enabled (its package may be missing)."""
    made: list[Monitor] = []
    if config.tensorboard.enabled:
        from dslaunch.runtime.monitors.tensorboard import TensorBoardMonitor

        made.append(TensorBoardMonitor(config.tensorboard))
    if config.csv_monitor.enabled:
        from dslaunch.runtime.monitors.csv_monitor import csvMonitor

        made.append(csvMonitor(config.csv_monitor))
    if config.wandb.enabled:
        from dslaunch.runtime.monitors.wandb import WandbMonitor

        made.append(WandbMonitor(config.wandb))
    if config.comet.enabled:
        from dslaunch.runtime.monitors.comet import CometMonitor

        made.append(CometMonitor(config.comet))
    return made


class _StartAt:
    __slots__ = ("samples",)

    def __init__(self, samples: int):
        self.samples = samples


def _plain(value: Any) -> Any:
    """A number or a string: tensors (and lazy values such as a mean loss) are read here."""
    return value if isinstance(value, (str, int, float)) else float(value)


class MonitorMaster(Monitor):
    """Every enabled monitor of ``monitor_config`` (DeepSpeed's ``ds_config.monitor_config``).

    ``engine.monitor`` is one; a script may write its own events through it, as in DeepSpeed:
    ``engine.monitor.write_events([("Eval/Samples/loss", loss, engine.global_samples)])``.

    Args:
        monitor_config: the four blocks.
        rank: this process's global rank (default: torch.distributed's, else ``$RANK``).
    """

    def __init__(self, monitor_config: DeepSpeedMonitorConfig, rank: int | None = None):
        super().__init__(monitor_config)
        self.enabled = monitor_config.enabled
        self.backends: list[Monitor] = []
        self._writer: BackgroundWriter | None = None
        if self.enabled and (_rank() if rank is None else rank) == 0:
            self.backends = _backends(monitor_config)
            self._writer = BackgroundWriter(self._write, self._flush_backends)
            atexit.register(self.close, EXIT_BOUND_S)

    def start_at(self, samples: int) -> None:
        if self._writer is not None:
            self._writer.put(_StartAt(int(samples)))

    def write_events(self, event_list: Iterable[Event]) -> None:
        """Queue the events (rank 0; elsewhere a no-op)."""
        if self._writer is not None:
            self._writer.put(list(event_list))

    def flush(self) -> None:
        """Block until everything queued is written and flushed."""
        if self._writer is not None:
            self._writer.flush()

    def close(self, timeout: float | None = 60.0) -> None:
        """Write what is queued and close every backend (later events are dropped); waits at most
        ``timeout`` seconds for the writer."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close(timeout)
            for backend in self.backends:
                backend.close()

    # ----- on the writer thread -----------------------------------------------------------------
    def _write(self, item: Any) -> None:
        if isinstance(item, _StartAt):
            for backend in self.backends:
                backend.start_at(item.samples)
            return
        events = [(name, _plain(value), int(step)) for name, value, step in item]
        for backend in self.backends:
            backend.write_events(events)

    def _flush_backends(self) -> None:
        for backend in self.backends:
            backend.flush()
