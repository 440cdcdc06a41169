"""``deepspeed.runtime.fp16``: DeepSpeed's fp16 optimizer wrappers (``fused_optimizer.py``,
``unfused_optimizer.py``): the classes ``engine.optimizer`` is at ZeRO stage 0 with fp16 (or bf16),
as DeepSpeed's (``runtime/zero/optimizer_view.py``); making one by hand is refused, the engine wraps
the optimizer itself, chosen by ds_config's ``fp16``/``bf16`` blocks. ``loss_scaler.py``:
DeepSpeed's loss-scaler classes on dslaunch's rules (scripts allow them to load DeepSpeed's files).
"""

from dslaunch.utils.refused import Refusal

MIXED_PRECISION_WRAPPER = Refusal("a stand-alone mixed-precision optimizer wrapper",
                                  "set \"fp16\" or \"bf16\" in the ds_config; the engine wraps the optimizer itself")

__all__ = ["MIXED_PRECISION_WRAPPER"]
