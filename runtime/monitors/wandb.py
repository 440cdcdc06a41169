"""DeepSpeed's ``WandbMonitor``: a Weights & Biases run (``wandb.init(project, group, entity=team)``);
each step's events go in one ``log`` call at that step. wandb's own settings apply (``WANDB_MODE=
offline`` writes the run under ``WANDB_DIR`` with no network)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dslaunch.runtime.config.monitors import WandbConfig
from dslaunch.runtime.monitors.monitor import Event, Monitor

__all__ = ["WandbMonitor"]


def by_step(event_list: Sequence[Event]) -> dict[int, dict[str, Any]]:
    """The events grouped by step, steps in order of first appearance."""
    grouped: dict[int, dict[str, Any]] = {}
    for name, value, step in event_list:
        grouped.setdefault(step, {})[name] = value
    return grouped


class WandbMonitor(Monitor):
    def __init__(self, config: WandbConfig):
        super().__init__(config)
        import wandb

        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, event_list: Sequence[Event]) -> None:
        for step, values in by_step(event_list).items():
            self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
