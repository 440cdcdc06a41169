"""``deepspeed.ops.sparse_attention``: block-sparse self-attention, a thin re-export of
``dslaunch.runtime.sparse_attention`` (layouts, modules, utilities) and
``dslaunch.kernels.block_sparse``, at DeepSpeed's module paths: ``sparsity_config.py``,
``sparse_self_attention.py``, ``bert_sparse_self_attention.py``, ``sparse_attention_utils.py``,
``matmul.py`` (``MatMul``) and ``softmax.py`` (``Softmax``)."""

from dslaunch.runtime.sparse_attention.attention import BertSparseSelfAttention, SparseSelfAttention
from dslaunch.runtime.sparse_attention.layouts import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from dslaunch.runtime.sparse_attention.utils import SparseAttentionUtils

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
           "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils"]
