"""The tile index of a block-sparse layout, and the products that read only the kept tiles.

``BlockLayout`` turns a 0/1 layout ``[H, R, C]`` into the head, block-row and block-column of each
kept tile (``layout.nonzero()`` order, DeepSpeed's). The products work on 4-d operands whose
first two dimensions (batch ``Z``, heads ``H``) are already equal (expanded):

- ``sdd(a, b)``: the kept tiles of the dense product ``a @ b`` -> ``[Z, nnz, bs, bs]``;
- ``spmm(s, transposed, d)``: block-sparse ``s`` (or its transpose) times dense ``d`` -> dense;
- ``mmsp(d, s, transposed)``: dense ``d`` times block-sparse ``s`` (or its transpose) -> dense.

They gather the tiles' rows and columns in slices of ``chunk_tiles`` tiles, so a temporary is at
most a slice's worth (``TILE_BUDGET`` elements): memory follows the kept tiles, never the dense
square. Half-precision sums accumulate in fp32 (tile products included). Not differentiable themselves: ``matmul.py``
defines the gradients with the same three products.
"""

from __future__ import annotations

import torch

from dslaunch.errors import SparsityConfigError

__all__ = ["BlockLayout", "sdd", "spmm", "mmsp", "TILE_BUDGET"]

#: Elements a gathered slice of operand tiles may hold (64 MiB in fp32).
TILE_BUDGET = 1 << 24


class BlockLayout:
    """A layout's kept tiles, indexed (per device, on first use).

    Args:
        layout: 0/1 tensor ``[H, R, C]`` (or ``[R, C]``: one head).
        block: the tile size.

    Raises:
        SparsityConfigError: a layout that is not 2-d or 3-d, or a block size below 1.
    """

    def __init__(self, layout: torch.Tensor, block: int):
        if layout.dim() not in (2, 3):
            raise SparsityConfigError(f"layout must be [heads, block rows, block columns] (or 2-d), got shape "
                                      f"{tuple(layout.shape)}")
        if not isinstance(block, int) or block < 1:
            raise SparsityConfigError(f"block={block!r}: must be a positive integer")
        layout = layout.detach().to("cpu", torch.int64)
        self.layout = layout.unsqueeze(0) if layout.dim() == 2 else layout
        self.block = block
        self.heads, self.rows, self.cols = self.layout.shape
        tiles = self.layout.nonzero()
        self.nnz = int(tiles.shape[0])
        self._tiles = tiles.t().contiguous()  # [3, nnz]: head, block row, block column
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tiles(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(head, row, col)`` of each kept tile, int64 on ``device``."""
        if device not in self._on:
            h, r, c = self._tiles.to(device)
            self._on[device] = (h, r, c)
        return self._on[device]

    def row_groups(self, device: torch.device) -> torch.Tensor:
        """Each tile's block row across heads (``head * R + row``): the softmax's segments."""
        h, r, _ = self.tiles(device)
        return h * self.rows + r


def _slices(count: int, tile_elems: int) -> list[slice]:
    step = max(1, TILE_BUDGET // max(1, tile_elems))
    return [slice(i, min(i + step, count)) for i in range(0, count, step)]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def sdd(a: torch.Tensor, b: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """The kept tiles of ``a @ b``.

    Args:
        a: ``[Z, H, M, K]`` with ``M = R * block``.
        b: ``[Z, H, K, N]`` with ``N = C * block``.
        lay: the layout of the result.

    Returns:
        ``[Z, nnz, block, block]`` in ``a``'s dtype.
    """
    bs = lay.block
    z, k = a.shape[0], a.shape[-1]
    h, r, c = lay.tiles(a.device)
    a_rows = a.unflatten(2, (lay.rows, bs))  # [Z, H, R, bs, K]
    b_cols = b.unflatten(3, (lay.cols, bs)).permute(0, 1, 3, 2, 4)  # [Z, H, C, K, bs]
    out = a.new_empty((z, lay.nnz, bs, bs))
    for s in _slices(lay.nnz, 2 * z * bs * k):
        out[:, s] = torch.matmul(a_rows[:, h[s], r[s]], b_cols[:, h[s], c[s]])
    return out


def spmm(s: torch.Tensor, transposed: bool, d: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """Block-sparse ``s`` (its transpose if ``transposed``) times dense ``d``.

    Args:
        s: ``[Z, nnz, block, block]`` of layout ``lay`` (``[H, R, C]``).
        transposed: multiply by ``s``'s transpose (layout ``[H, C, R]``).
        d: ``[Z, H, K, N]``, ``K`` the sparse operand's column count.
        lay: the layout of ``s`` as stored.

    Returns:
        ``[Z, H, M, N]`` (``M`` the sparse operand's row count) in ``s``'s dtype.
    """
    bs = lay.block
    z, heads, n = d.shape[0], d.shape[1], d.shape[-1]
    h, r, c = lay.tiles(s.device)
    out_row, in_col = (c, r) if transposed else (r, c)
    out_rows = lay.cols if transposed else lay.rows
    d_rows = d.unflatten(2, (d.shape[2] // bs, bs))  # [Z, H, K/bs, bs, N]
    acc = torch.zeros((z, heads * out_rows, bs, n), dtype=_acc_dtype(s.dtype), device=s.device)
    target = h * out_rows + out_row
    for sl in _slices(lay.nnz, 2 * z * bs * n):
        tile = s[:, sl].transpose(-1, -2) if transposed else s[:, sl]
        # each tile's product in the accumulator's dtype: rounding it first would lose what the sum cancels
        acc.index_add_(1, target[sl], torch.matmul(tile.to(acc.dtype), d_rows[:, h[sl], in_col[sl]].to(acc.dtype)))
    return acc.view(z, heads, out_rows * bs, n).to(s.dtype)


def mmsp(d: torch.Tensor, s: torch.Tensor, transposed: bool, lay: BlockLayout) -> torch.Tensor:
    """Dense ``d`` times block-sparse ``s`` (its transpose if ``transposed``): ``(s^T d^T)^T``.

    Args:
        d: ``[Z, H, M, K]``.
        s: ``[Z, nnz, block, block]`` of layout ``lay``.
        transposed: multiply by ``s``'s transpose.
        lay: the layout of ``s`` as stored.

    Returns:
        ``[Z, H, M, N]`` in ``s``'s dtype.
    """
    return spmm(s, not transposed, d.transpose(-1, -2), lay).transpose(-1, -2)
