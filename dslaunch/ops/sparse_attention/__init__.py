"""``deepspeed.ops.sparse_attention``: importable, refused on use (dslaunch has no block-sparse
attention kernels). The refusal is ``sparsity_config.SPARSE_ATTENTION`` (``sparsity_config.py``).
"""

from dslaunch.ops.sparse_attention.sparsity_config import SPARSE_ATTENTION as _WHY
from dslaunch.ops.sparse_attention.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)
from dslaunch.utils.refused import refuse

_REFUSED = ("SparseSelfAttention", "BertSparseSelfAttention", "SparseAttentionUtils")
globals().update(refuse(__name__, _REFUSED, _WHY))

__all__ = ["SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig", *_REFUSED]
