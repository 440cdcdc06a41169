"""The tile index of a block-sparse layout, and the products that read only the kept tiles.

``BlockLayout`` turns a 0/1 layout ``[H, R, C]`` into the head, block-row and block-column of each
kept tile (``layout.nonzero()`` order, DeepSpeed's). The products work on 4-d operands whose
first two dimensions (batch ``Z``, heads ``H``) are already equal (expanded):

- ``sdd(a, b)``: the kept tiles of the dense product ``a @ b`` -> ``[Z, nnz, bs, bs]``;
- ``spmm(s, transposed, d)``: block-sparse ``s`` (or its transpose) times dense ``d`` -> dense;
- ``mmsp(d, s, transposed)``: dense ``d`` times block-sparse ``s`` (or its transpose) -> dense.

They work per output block row (DeepSpeed's look-up table): the tiles of one block row are
multiplied side by side in one matrix product with the operand rows they meet (``Groups``: rows
padded to their slice's longest, the block rows sorted by length so padding stays small), in
slices of at most ``TILE_BUDGET`` gathered elements: memory follows the kept tiles, never the
dense square. Half-precision sums accumulate in fp32 (tile products included). Not
differentiable themselves: ``matmul.py`` defines the gradients with the same three products.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dslaunch.errors import SparsityConfigError

__all__ = ["BlockLayout", "Groups", "sdd", "spmm", "mmsp", "TILE_BUDGET"]

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
        self._groups: dict[tuple[torch.device, bool], Groups] = {}

    def tiles(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(head, row, col)`` of each kept tile, int64 on ``device``."""
        if device not in self._on:
            h, r, c = self._tiles.to(device)
            self._on[device] = (h, r, c)
        return self._on[device]

    def groups(self, device: torch.device, by_col: bool) -> Groups:
        """The tiles grouped by block row (``by_col``: by block column, for the transpose)."""
        key = (device, by_col)
        if key not in self._groups:
            h, r, c = self._tiles
            out, other, per_head = (c, r, self.cols) if by_col else (r, c, self.rows)
            g = _group(h, out, other, per_head, self.heads, self.nnz)
            self._groups[key] = Groups(g.ids.to(device), g.counts, g.tile.to(device), g.other.to(device))
        return self._groups[key]

    def row_groups(self, device: torch.device) -> torch.Tensor:
        """Each tile's block row across heads (``head * R + row``): the softmax's segments."""
        h, r, _ = self.tiles(device)
        return h * self.rows + r


@dataclass(frozen=True)
class Groups:
    """The tiles grouped by output block row (DeepSpeed's look-up table, padded): group ``i`` of
    ``ids`` (``head * G + block``) holds ``counts[i]`` tiles, listed in ``tile[i, :count]`` with the
    block of the other operand each one meets in ``other[i, :count]``; the padding points at tile
    ``nnz`` (a zero tile) and block 0. Groups are sorted by count, largest first, so a slice of
    consecutive groups is padded only to its own largest count."""

    ids: torch.Tensor
    counts: list[int]
    tile: torch.Tensor
    other: torch.Tensor


def _group(h: torch.Tensor, out: torch.Tensor, other: torch.Tensor, per_head: int, heads: int,
           nnz: int) -> Groups:
    key = h * per_head + out
    count = torch.bincount(key, minlength=heads * per_head)
    order = torch.argsort(key, stable=True)
    start = torch.cumsum(count, 0) - count
    pos = torch.empty_like(order)
    pos[order] = torch.arange(nnz) - start[key[order]]
    width = int(count.max()) if nnz else 0
    tile = torch.full((heads * per_head, width), nnz, dtype=torch.int64)
    slot = torch.zeros((heads * per_head, width), dtype=torch.int64)
    tile[key, pos] = torch.arange(nnz)
    slot[key, pos] = other
    ids = torch.argsort(count, descending=True, stable=True)
    return Groups(ids, count[ids].tolist(), tile[ids], slot[ids])


def _slices(groups: Groups, elems_per_slot: int) -> list[tuple[slice, int]]:
    """Consecutive groups whose padded operands stay within ``TILE_BUDGET``, with their width."""
    out, i, n = [], 0, len(groups.counts)
    while i < n and groups.counts[i] > 0:
        width = groups.counts[i]
        step = max(1, TILE_BUDGET // max(1, width * elems_per_slot))
        out.append((slice(i, min(i + step, n)), width))
        i += step
    return out


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _blocks(x: torch.Tensor, count: int, bs: int) -> torch.Tensor:
    """``[Z, H, count * bs, n]`` -> ``[Z, H * count, bs, n]`` (a copy only if ``x`` is not contiguous)."""
    z, heads, _, n = x.shape
    return x.reshape(z, heads * count, bs, n)


def sdd(a: torch.Tensor, b: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """The kept tiles of ``a @ b``: per block row, one product of its rows with its tiles' columns.

    Args:
        a: ``[Z, H, M, K]`` with ``M = R * block``.
        b: ``[Z, H, K, N]`` with ``N = C * block``.
        lay: the layout of the result.

    Returns:
        ``[Z, nnz, block, block]`` in ``a``'s dtype.
    """
    bs, z, k = lay.block, a.shape[0], a.shape[-1]
    groups = lay.groups(a.device, by_col=False)
    a_rows = _blocks(a, lay.rows, bs)  # [Z, H*R, bs, K]
    b_cols = _blocks(b.transpose(-1, -2), lay.cols, bs)  # [Z, H*C, bs, K]
    out = a.new_empty((z, lay.nnz, bs, bs))
    heads_of = groups.ids // lay.rows
    for sl, width in _slices(groups, 2 * z * bs * k):
        ids, tile = groups.ids[sl], groups.tile[sl, :width].flatten()
        cols = b_cols.index_select(1, (heads_of[sl, None] * lay.cols + groups.other[sl, :width]).flatten())
        cols = cols.reshape(z, len(ids), width * bs, k)
        prod = torch.matmul(a_rows.index_select(1, ids), cols.transpose(-1, -2))  # [Z, g, bs, width*bs]
        prod = prod.reshape(z, len(ids), bs, width, bs).transpose(2, 3).reshape(z, -1, bs, bs)
        if groups.counts[min(sl.stop, len(groups.counts)) - 1] < width:  # padded slots: drop their results
            real = tile < lay.nnz
            tile, prod = tile[real], prod[:, real]
        out.index_copy_(1, tile, prod)
    return out


def spmm(s: torch.Tensor, transposed: bool, d: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """Block-sparse ``s`` (its transpose if ``transposed``) times dense ``d``: per output block row,
    one product of its tiles side by side with the matching rows of ``d``.

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
    out_rows, in_rows = (lay.cols, lay.rows) if transposed else (lay.rows, lay.cols)
    groups = lay.groups(s.device, by_col=transposed)
    acc = _acc_dtype(s.dtype)
    out = torch.zeros((z, heads * out_rows, bs, n), dtype=acc, device=s.device)
    padded = torch.cat([s, s.new_zeros((s.shape[0], 1, bs, bs))], 1)
    d_rows = _blocks(d, in_rows, bs)  # [Z, H*K/bs, bs, N]
    heads_of = groups.ids // out_rows
    for sl, width in _slices(groups, z * bs * (n + bs)):
        ids = groups.ids[sl]
        tiles = padded.index_select(1, groups.tile[sl, :width].flatten()).reshape(z, len(ids), width, bs, bs)
        if transposed:
            tiles = tiles.transpose(-1, -2)
        tiles = tiles.transpose(2, 3).reshape(z, len(ids), bs, width * bs)  # side by side
        rows = d_rows.index_select(1, (heads_of[sl, None] * in_rows + groups.other[sl, :width]).flatten())
        rows = rows.reshape(z, len(ids), width * bs, n)
        # the product in the accumulator's dtype: rounding per tile would lose what the sum cancels
        out[:, ids] = torch.matmul(tiles.to(acc), rows.to(acc))
    return out.view(z, heads, out_rows * bs, n).to(s.dtype)


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
