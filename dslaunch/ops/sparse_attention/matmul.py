"""``deepspeed.ops.sparse_attention.matmul``: ``MatMul`` (``dslaunch.kernels.block_sparse.matmul``)."""

from dslaunch.kernels.block_sparse.matmul import MatMul

__all__ = ["MatMul"]
