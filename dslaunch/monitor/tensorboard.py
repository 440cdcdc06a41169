"""DeepSpeed's ``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor``, implemented in
``dslaunch.runtime.monitors.tensorboard``."""

from dslaunch.runtime.monitors.tensorboard import TensorBoardMonitor

__all__ = ["TensorBoardMonitor"]
