"""Block-sparse matrices in DeepSpeed's format and the ops on them (torch, any device).

A block-sparse matrix of layout ``[H, R, C]`` (0/1 per ``block x block`` tile) is stored as
``[Z, nnz, block, block]``: the kept tiles of every batch entry ``z``, in the order of
``layout.nonzero()`` (head, then block row, then block column), DeepSpeed's order. Modules:
``format.py`` (the tile index of a layout, and the products that read only kept tiles),
``matmul.py`` (``MatMul``: sdd, dsd, dds, differentiable) and ``softmax.py`` (``Softmax``: the
row-wise softmax over the kept tiles with scale, relative position embedding and masks).

Memory is proportional to the kept tiles: no op builds the dense ``[Z, H, M, N]`` square.
"""

from dslaunch.kernels.block_sparse.format import BlockLayout
from dslaunch.kernels.block_sparse.matmul import MatMul
from dslaunch.kernels.block_sparse.softmax import Softmax

__all__ = ["BlockLayout", "MatMul", "Softmax"]
