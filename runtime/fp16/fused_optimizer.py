"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer`` names dslaunch's ``PrecisionPolicy``."""

from dslaunch.runtime.precision import PrecisionPolicy as FP16_Optimizer

__all__ = ["FP16_Optimizer"]
