"""DeepSpeed's ``deepspeed.monitor.csv_monitor``: ``csvMonitor``, implemented in
``dslaunch.runtime.monitors.csv_monitor``."""

from dslaunch.runtime.monitors.csv_monitor import csvMonitor

__all__ = ["csvMonitor"]
