"""``deepspeed.ops.sparse_attention.softmax``: ``Softmax`` (``dslaunch.kernels.block_sparse.softmax``)."""

from dslaunch.kernels.block_sparse.softmax import Softmax

__all__ = ["Softmax"]
