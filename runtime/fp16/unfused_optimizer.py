"""``deepspeed.runtime.fp16.unfused_optimizer``: ``FP16_UnfusedOptimizer`` names dslaunch's ``PrecisionPolicy``."""

from dslaunch.runtime.precision import PrecisionPolicy as FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
