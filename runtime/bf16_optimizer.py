"""``deepspeed.runtime.bf16_optimizer``: ``BF16_Optimizer``, refused on use (see ``runtime/fp16``)."""

from dslaunch.runtime.fp16 import MIXED_PRECISION_WRAPPER
from dslaunch.utils.refused import refused_class

BF16_Optimizer = refused_class(__name__, "BF16_Optimizer", MIXED_PRECISION_WRAPPER)

__all__ = ["BF16_Optimizer"]
