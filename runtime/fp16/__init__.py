"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers (``fused_optimizer.py``,
``unfused_optimizer.py``), refused on use: dslaunch's precision is a policy of the engine
(``runtime/precision``), chosen by ds_config's ``fp16``/``bf16`` blocks. The classes stay classes,
so Megatron's ``isinstance(optimizer, FP16_Optimizer)`` is False. ``loss_scaler.py``: DeepSpeed's
loss-scaler classes on dslaunch's rules (scripts allow them to load DeepSpeed's files).
"""

from dslaunch.utils.refused import Refusal

MIXED_PRECISION_WRAPPER = Refusal("a stand-alone mixed-precision optimizer wrapper",
                                  "set \"fp16\" or \"bf16\" in the ds_config; the engine wraps the optimizer itself")

__all__ = ["MIXED_PRECISION_WRAPPER"]
