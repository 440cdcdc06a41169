"""``deepspeed.runtime.fp16.fused_optimizer``: ``FP16_Optimizer`` (see ``runtime/fp16/__init__.py``): making one
is refused; the engine's optimizer under fp16/bf16 (``PrecisionPolicy``) is an instance of it to a
script that asks ``isinstance`` (DeepSpeed's checkpoint tests and Megatron do)."""

from dslaunch.runtime.fp16 import MIXED_PRECISION_WRAPPER
from dslaunch.runtime.precision import PrecisionPolicy
from dslaunch.utils.refused import refused_class

FP16_Optimizer = refused_class(__name__, "FP16_Optimizer", MIXED_PRECISION_WRAPPER, stands_for=PrecisionPolicy)

__all__ = ["FP16_Optimizer"]
