"""DeepSpeed's ``TensorBoardMonitor``: scalars (and text) in event files under
``output_path/job_name/``, read by TensorBoard (``torch.utils.tensorboard``; needs ``tensorboard``).

A resumed run opens a new event file whose first record tells TensorBoard to drop every point at
or past the first step not covered by the checkpoint (torch's ``purge_step``), so a run killed
after its last checkpoint and resumed reads as one curve, without the lost attempt's tail.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from dslaunch.monitor.config import TensorBoardConfig
from dslaunch.monitor.monitor import Event, Monitor

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    def __init__(self, config: TensorBoardConfig):
        super().__init__(config)
        self.log_dir = os.path.join(config.output_path, config.job_name)
        self._purge_step: int | None = None
        self._writer: Any = None

    def start_at(self, samples: int) -> None:
        if self._writer is None:
            self._purge_step = samples + 1

    def _summary_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.log_dir, purge_step=self._purge_step)
        return self._writer

    def write_events(self, event_list: Sequence[Event]) -> None:
        writer = self._summary_writer()
        for name, value, step in event_list:
            if isinstance(value, str):
                writer.add_text(name, value, step)
            else:
                writer.add_scalar(name, value, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
