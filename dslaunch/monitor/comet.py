"""DeepSpeed's ``deepspeed.monitor.comet``: ``CometMonitor``, implemented in
``dslaunch.runtime.monitors.comet``."""

from dslaunch.runtime.monitors.comet import CometMonitor

__all__ = ["CometMonitor"]
