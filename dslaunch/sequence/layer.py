"""``deepspeed.sequence.layer``: DeepSpeed-Ulysses' ``DistributedAttention``
(``runtime/sequence_parallel/attention.py``)."""

from dslaunch.runtime.sequence_parallel.attention import DistributedAttention

__all__ = ["DistributedAttention"]
