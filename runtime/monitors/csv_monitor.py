"""DeepSpeed's ``csvMonitor``: one CSV file per metric under ``output_path/job_name/``, named after
the event (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``), with the header ``step,<last part>``.

Unlike DeepSpeed's, a resumed run (or a rerun under the same job name) appends to the files
without a second header, and first drops the rows an earlier attempt logged past the point the run
resumed from (``start_at``), and a row torn by a kill: each file stays one sorted series.

Files are written by ``dslaunch.safe_write``'s rule: a planted link is never written through, and
an output directory another user controls is refused with one warning (training goes on).
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import IO, Any

from dslaunch.runtime.config.monitors import CSVConfig
from dslaunch.runtime.monitors.monitor import Event, Monitor
from dslaunch.safe_write import append_file, open_dir, write_file

__all__ = ["csvMonitor"]


def file_name(log_name: str) -> str:
    return log_name.replace("/", "_").replace(" ", "_") + ".csv"


def _kept_lines(dir_fd: int, name: str, after: int | None) -> tuple[list[str], bool]:
    """The header and the complete rows of ``name`` up to step ``after`` (all rows if None), and
    whether anything was dropped. Read without following a link (``append_file`` checked it)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with open(fd, newline="", encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    kept = [line for line in lines if line.endswith("\n")]
    if kept:
        kept = kept[:1] + [line for line in kept[1:] if _keeps(line, after)]
    return kept, len(kept) != len(lines)


def _keeps(line: str, after: int | None) -> bool:
    step = line.split(",", 1)[0]
    return step.lstrip("-").isdigit() and (after is None or int(step) <= after)


class csvMonitor(Monitor):  # noqa: N801 (DeepSpeed's class name)
    def __init__(self, config: CSVConfig):
        super().__init__(config)
        self.output_path, self.job_name = config.output_path, config.job_name  # DeepSpeed's attributes
        self.log_dir = os.path.join(config.output_path, config.job_name)
        self._after: int | None = None
        self._files: dict[str, tuple[IO[str], Any]] = {}
        self._dir_fd: int | None = None

    def start_at(self, samples: int) -> None:
        self._after = samples

    def _open(self, log_name: str) -> Any:
        """The csv writer of ``log_name``'s file, opened (and repaired) on first use, by
        ``safe_write``'s rule: a link or a directory others control is refused, never written
        through (the writer then warns once and this monitor stops)."""
        if log_name in self._files:
            return self._files[log_name][1]
        if self._dir_fd is None:
            self._dir_fd = open_dir(self.log_dir)
        name = file_name(log_name)
        f = append_file(self._dir_fd, name)
        try:
            header = os.fstat(f.fileno()).st_size > 0
            if header:
                kept, dropped = _kept_lines(self._dir_fd, name, self._after)
                if dropped:  # rewrite whole, then swap in: a kill now leaves the old file or the new one
                    f.close()
                    write_file(self._dir_fd, name, "".join(kept))
                    f = append_file(self._dir_fd, name)
                header = bool(kept)
        except BaseException:
            f.close()
            raise
        writer = csv.writer(f)
        if not header:
            writer.writerow(["step", log_name.rsplit("/", 1)[-1]])
        self._files[log_name] = (f, writer)
        return writer

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            self._open(name).writerow([step, value])

    def flush(self) -> None:
        for f, _ in self._files.values():
            f.flush()

    def close(self) -> None:
        for f, _ in self._files.values():
            f.close()
        self._files.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
