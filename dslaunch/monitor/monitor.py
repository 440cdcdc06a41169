"""DeepSpeed's ``deepspeed.monitor.monitor``: ``Monitor``, ``MonitorMaster``, ``Event``, implemented in
``dslaunch.runtime.monitors.monitor``."""

from dslaunch.runtime.monitors.monitor import Event, Monitor, MonitorMaster

__all__ = ["Monitor", "MonitorMaster", "Event"]
