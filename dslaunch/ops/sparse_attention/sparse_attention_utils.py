"""``deepspeed.ops.sparse_attention.sparse_attention_utils``: ``SparseAttentionUtils``
(``dslaunch.runtime.sparse_attention.utils``)."""

from dslaunch.runtime.sparse_attention.utils import SparseAttentionUtils

__all__ = ["SparseAttentionUtils"]
