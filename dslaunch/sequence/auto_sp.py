"""``deepspeed.sequence.auto_sp``: AutoSP's ``auto_wrap_model_for_sp``
(``runtime/sequence_parallel/auto_wrap.py``)."""

from dslaunch.runtime.sequence_parallel.auto_wrap import auto_wrap_model_for_sp
from dslaunch.runtime.sequence_parallel.detector import _VIT_HAS_CLS_TOKEN, detect_model_sp_info
from dslaunch.runtime.sequence_parallel.vit_attention import UlyssesSPViTAttention

__all__ = ["auto_wrap_model_for_sp", "detect_model_sp_info", "UlyssesSPViTAttention", "_VIT_HAS_CLS_TOKEN"]
