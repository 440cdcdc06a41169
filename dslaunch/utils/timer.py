"""``deepspeed.utils.timer``: ``trim_mean`` (the comms logger's, ``dslaunch.utils.comms_logging``)."""

from dslaunch.utils.comms_logging import trim_mean

__all__ = ["trim_mean"]
