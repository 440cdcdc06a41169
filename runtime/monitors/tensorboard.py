"""DeepSpeed's ``TensorBoardMonitor``: scalars (and text) in TensorBoard event files under
``output_path/job_name/`` (the ``tensorboard`` package's record format and protos).

Each step's events go in one event record (one summary with a value per metric), written straight
to the file by the monitors' thread: no per-metric record and no second writer thread, as torch's
``SummaryWriter`` would make. A resumed run opens a new event file that starts with a session-start
record at the first step the checkpoint does not cover; TensorBoard's reader then drops every
point at or past it from earlier files (torch's ``purge_step``), so a run killed after its last
checkpoint and resumed reads as one curve, without the lost attempt's tail.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

from dslaunch.runtime.config.monitors import TensorBoardConfig
from dslaunch.runtime.monitors.monitor import Event, Monitor
from dslaunch.safe_write import create_new

__all__ = ["TensorBoardMonitor"]


def _masked_crc(data: bytes) -> int:
    """TFRecord's checksum: CRC-32C, rotated and offset (hardware CRC32C: tensorboard's own is Python)."""
    import crc32c

    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _record(data: bytes) -> bytes:
    """One TFRecord: length, its checksum, the data, its checksum."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


def _summary(events: list[tuple[str, Any]]) -> Any:
    from tensorboard.compat.proto.summary_pb2 import Summary

    summary = Summary()
    for name, value in events:
        if isinstance(value, str):
            from torch.utils.tensorboard.summary import text

            summary.value.extend(text(name, value).value)
        else:
            summary.value.add(tag=name, simple_value=float(value))
    return summary


class TensorBoardMonitor(Monitor):
    def __init__(self, config: TensorBoardConfig):
        super().__init__(config)
        self.log_dir = os.path.join(config.output_path, config.job_name)
        self._purge_step: int | None = None
        self._file: Any = None

    def start_at(self, samples: int) -> None:
        if self._file is None:
            self._purge_step = samples + 1

    def _add(self, **fields: Any) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as EventProto

        if self._file is None:
            self._open()
        self._file.write(_record(EventProto(wall_time=time.time(), **fields).SerializeToString()))

    def _open(self) -> None:
        from tensorboard.compat.proto.event_pb2 import Event as EventProto
        from tensorboard.compat.proto.event_pb2 import SessionLog
        # TensorBoard's file name: readers order a directory's files by it (the time first). Created
        # new by safe_write's rule: a link planted under the name is refused, never written through.
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self._file = os.fdopen(create_new(self.log_dir, name, 0o644), "wb")
        first = [EventProto(wall_time=time.time(), file_version="brain.Event:2")]
        if self._purge_step is not None:
            first.append(EventProto(wall_time=time.time(), step=self._purge_step,
                                    session_log=SessionLog(status=SessionLog.START)))
        for event in first:
            self._file.write(_record(event.SerializeToString()))

    def write_events(self, event_list: Sequence[Event]) -> None:
        steps: dict[int, list[tuple[str, Any]]] = {}
        for name, value, step in event_list:
            steps.setdefault(step, []).append((name, value))
        for step, events in steps.items():
            self._add(step=step, summary=_summary(events))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
