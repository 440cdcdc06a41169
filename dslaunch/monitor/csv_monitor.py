"""DeepSpeed's ``csvMonitor``: one CSV file per metric under ``output_path/job_name/``, named after
the event (``Train/Samples/lr`` -> ``Train_Samples_lr.csv``), with the header ``step,<last part>``.

Unlike DeepSpeed's, a resumed run (or a rerun under the same job name) appends to the files
without a second header, and first drops the rows an earlier attempt logged past the point the run
resumed from (``start_at``), and a row torn by a kill: each file stays one sorted series.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import IO, Any

from dslaunch.monitor.config import CSVConfig
from dslaunch.monitor.monitor import Event, Monitor

__all__ = ["csvMonitor"]


def file_name(log_name: str) -> str:
    return log_name.replace("/", "_").replace(" ", "_") + ".csv"


def _kept_lines(path: str, after: int | None) -> tuple[list[str], bool]:
    """The header and the complete rows of ``path`` up to step ``after`` (all rows if None), and
    whether anything was dropped."""
    with open(path, newline="") as f:
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

    def start_at(self, samples: int) -> None:
        self._after = samples

    def _open(self, log_name: str) -> Any:
        """The csv writer of ``log_name``'s file, opened (and repaired) on first use."""
        if log_name in self._files:
            return self._files[log_name][1]
        os.makedirs(self.log_dir, exist_ok=True)
        path = os.path.join(self.log_dir, file_name(log_name))
        header = bool(os.path.exists(path) and os.path.getsize(path))
        if header:
            kept, dropped = _kept_lines(path, self._after)
            if dropped:  # rewrite whole, then swap in: a kill now leaves the old file or the new one
                with open(path + ".tmp", "w", newline="") as f:
                    f.writelines(kept)
                os.replace(path + ".tmp", path)
            header = bool(kept)
        f = open(path, "a", newline="")  # noqa: SIM115 (kept open for the run)
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
