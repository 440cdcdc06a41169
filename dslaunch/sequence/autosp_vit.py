"""``deepspeed.sequence.autosp_vit``: AutoSP's ``UlyssesSPViTAttention``
(``runtime/sequence_parallel/vit_attention.py``)."""

from dslaunch.runtime.sequence_parallel.vit_attention import UlyssesSPViTAttention

__all__ = ["UlyssesSPViTAttention"]
