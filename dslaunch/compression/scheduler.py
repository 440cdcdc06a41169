"""``deepspeed.compression.scheduler``: ``compression_scheduler`` (from
``dslaunch.runtime.compression.scheduler``)."""

from dslaunch.runtime.compression.scheduler import compression_scheduler

__all__ = ["compression_scheduler"]
