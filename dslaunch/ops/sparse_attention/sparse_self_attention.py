"""``deepspeed.ops.sparse_attention.sparse_self_attention``: ``SparseSelfAttention``
(``dslaunch.runtime.sparse_attention.attention``)."""

from dslaunch.runtime.sparse_attention.attention import SparseSelfAttention

__all__ = ["SparseSelfAttention"]
