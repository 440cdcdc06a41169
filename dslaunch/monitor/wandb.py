"""DeepSpeed's ``deepspeed.monitor.wandb``: ``WandbMonitor``, implemented in
``dslaunch.runtime.monitors.wandb``."""

from dslaunch.runtime.monitors.wandb import WandbMonitor

__all__ = ["WandbMonitor"]
