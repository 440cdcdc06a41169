"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer``, refused on use (see ``runtime/fp16/__init__.py``)."""

from dslaunch.runtime.fp16 import MIXED_PRECISION_WRAPPER
from dslaunch.utils.refused import refused_class

FP16_UnfusedOptimizer = refused_class(__name__, "FP16_UnfusedOptimizer", MIXED_PRECISION_WRAPPER)

__all__ = ["FP16_UnfusedOptimizer"]
