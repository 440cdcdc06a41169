"""``deepspeed.ops.sparse_attention``: block-sparse self-attention, a thin re-export of
``dslaunch.runtime.sparse_attention`` (layouts, modules, utilities) and
``dslaunch.kernels.block_sparse``, at DeepSpeed's module paths: ``sparsity_config.py``,
``sparse_self_attention.py``, ``bert_sparse_self_attention.py``, ``sparse_attention_utils.py``,
``matmul.py`` (``MatMul``) and ``softmax.py`` (``Softmax``)."""

from dslaunch.ops.sparse_attention import sparsity_config
from dslaunch.ops.sparse_attention.sparsity_config import *  # noqa: F403  (the layouts, as DeepSpeed's package has them)
from dslaunch.runtime.sparse_attention.attention import BertSparseSelfAttention, SparseSelfAttention
from dslaunch.runtime.sparse_attention.utils import SparseAttentionUtils

__all__ = [*sparsity_config.__all__, "SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils"]
