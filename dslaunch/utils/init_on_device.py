"""``deepspeed.utils.init_on_device``: ``OnDevice`` (``runtime/zero/partition_parameters.py``)."""

from dslaunch.runtime.zero.partition_parameters import OnDevice

__all__ = ["OnDevice"]
