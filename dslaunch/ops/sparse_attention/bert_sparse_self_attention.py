"""``deepspeed.ops.sparse_attention.bert_sparse_self_attention``: ``BertSparseSelfAttention``
(``dslaunch.runtime.sparse_attention.attention``)."""

from dslaunch.runtime.sparse_attention.attention import BertSparseSelfAttention

__all__ = ["BertSparseSelfAttention"]
