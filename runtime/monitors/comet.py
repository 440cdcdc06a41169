"""DeepSpeed's ``CometMonitor``: a Comet experiment (``comet_ml.start``); each metric is logged at
most once per ``samples_log_interval`` samples (its first event always). ``online: false`` writes
an offline archive (under ``COMET_OFFLINE_DIRECTORY``) with no network."""

from __future__ import annotations

from collections.abc import Sequence

from dslaunch.runtime.config.monitors import CometConfig
from dslaunch.runtime.monitors.monitor import Event, Monitor

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    def __init__(self, config: CometConfig):
        super().__init__(config)
        import comet_ml

        self.interval = config.samples_log_interval
        self._last: dict[str, int] = {}  # metric -> samples at its last log
        self.experiment = comet_ml.start(
            api_key=config.api_key, project=config.project, workspace=config.workspace,
            experiment_key=config.experiment_key, mode=config.mode, online=config.online,
            experiment_config=comet_ml.ExperimentConfig(name=config.experiment_name))

    def _due(self, name: str, step: int) -> bool:
        last = self._last.get(name)
        if last is not None and step - last < self.interval:
            return False
        self._last[name] = step
        return True

    def write_events(self, event_list: Sequence[Event]) -> None:
        for name, value, step in event_list:
            if isinstance(value, str):
                self.experiment.log_text(value, step=step, metadata={"name": name})
            elif self._due(name, step):
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
