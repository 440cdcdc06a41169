"""The block-sparse products in Triton (the ``"block_sparse_sdd"`` and ``"block_sparse_spmm"`` ops).

Same signatures and results as ``dslaunch.kernels.block_sparse.format``'s ``sdd`` and ``spmm``:

- ``sdd(a, b, lay)``: one program per kept tile and batch entry, ``a``'s tile rows times ``b``'s
  tile columns over the inner dimension in steps of ``BLOCK_K``;
- ``spmm(s, transposed, d, lay)``: one program per output block row, batch entry and ``BLOCK_N``
  columns, summing its tiles (the padded group table of ``format.Groups``) times the rows of ``d``
  they meet; a block row without tiles writes zeros.

Tiles are converted to fp32 and multiplied with ``tl.dot(input_precision="ieee")`` (no TF32
rounding; half inputs take no tensor-core half products yet: correctness first, and Triton's
interpreter multiplies bf16 tiles wrongly), summed in fp32, stored in the inputs' dtype. Operands are read through their strides (no copy).
Limitations: tiles of a power of two from 16 up (``tl.dot``'s smallest), as DeepSpeed's blocks
are; other block sizes run the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslaunch.kernels.block_sparse import format as reference
from dslaunch.kernels.block_sparse.format import BlockLayout

__all__ = ["sdd", "spmm"]

_BLOCK_K = 32
_BLOCK_N = 64


@triton.jit
def _sdd_kernel(A, B, OUT, HEAD, ROW, COL, K, nnz,
                saz, sah, sam, sak, sbz, sbh, sbk, sbn,
                BS: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    h = tl.load(HEAD + t)
    r = tl.load(ROW + t)
    c = tl.load(COL + t)
    i = tl.arange(0, BS)
    kk = tl.arange(0, BLOCK_K)
    a_ptr = A + z * saz + h * sah + (r * BS + i)[:, None] * sam
    b_ptr = B + z * sbz + h * sbh + (c * BS + i)[None, :] * sbn
    acc = tl.zeros((BS, BS), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        a = tl.load(a_ptr + k[None, :] * sak, mask=k[None, :] < K, other=0.0)
        b = tl.load(b_ptr + k[:, None] * sbk, mask=k[:, None] < K, other=0.0)
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    out = OUT + (z * nnz + t) * BS * BS + i[:, None] * BS + i[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty))


@triton.jit
def _spmm_kernel(S, D, OUT, IDS, COUNT, TILE, OTHER, width, out_rows, N, nnz,
                 sdz, sdh, sdk, sdn, soz, soh, som, son,
                 BS: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr):
    g = tl.program_id(0)
    z = tl.program_id(1).to(tl.int64)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    gid = tl.load(IDS + g)
    h = gid // out_rows
    row = gid % out_rows
    count = tl.load(COUNT + g)
    i = tl.arange(0, BS)
    acc = tl.zeros((BS, BLOCK_N), dtype=tl.float32)
    for w in range(0, count):
        tile = tl.load(TILE + g * width + w)
        other = tl.load(OTHER + g * width + w)
        base = S + (z * nnz + tile) * BS * BS
        if TRANSPOSED:  # the stored tile's transpose: element (i, j) is stored at (j, i)
            s = tl.load(base + i[None, :] * BS + i[:, None])
        else:
            s = tl.load(base + i[:, None] * BS + i[None, :])
        d = tl.load(D + z * sdz + h * sdh + (other * BS + i)[:, None] * sdk + n[None, :] * sdn,
                    mask=n[None, :] < N, other=0.0)
        acc += tl.dot(s.to(tl.float32), d.to(tl.float32), input_precision="ieee")
    out = OUT + z * soz + h * soh + (row * BS + i)[:, None] * som + n[None, :] * son
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=n[None, :] < N)


def _fits(block: int) -> bool:
    return block >= 16 and block & (block - 1) == 0


def sdd(a: torch.Tensor, b: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """The kept tiles of ``a @ b`` (``format.sdd``'s contract).

    Args:
        a: ``[Z, H, M, K]``.
        b: ``[Z, H, K, N]``.
        lay: the layout of the result.

    Returns:
        ``[Z, nnz, block, block]`` in ``a``'s dtype.
    """
    z, bs, k = a.shape[0], lay.block, a.shape[-1]
    if not _fits(bs):
        return reference.sdd(a, b, lay)
    out = a.new_empty((z, lay.nnz, bs, bs))
    if lay.nnz == 0 or z == 0:
        return out
    h, r, c = lay.tiles(a.device)
    _sdd_kernel[(lay.nnz, z)](a, b, out, h, r, c, k, lay.nnz, *a.stride(), *b.stride(),
                              BS=bs, BLOCK_K=_BLOCK_K)
    return out


def spmm(s: torch.Tensor, transposed: bool, d: torch.Tensor, lay: BlockLayout) -> torch.Tensor:
    """Block-sparse ``s`` (its transpose if ``transposed``) times dense ``d`` (``format.spmm``'s contract).

    Args:
        s: ``[Z, nnz, block, block]`` of layout ``lay``.
        transposed: multiply by ``s``'s transpose.
        d: ``[Z, H, K, N]``.
        lay: the layout of ``s`` as stored.

    Returns:
        ``[Z, H, M, N]`` in ``s``'s dtype.
    """
    bs = lay.block
    if not _fits(bs):
        return reference.spmm(s, transposed, d, lay)
    z, heads, n = d.shape[0], d.shape[1], d.shape[-1]
    out_rows = lay.cols if transposed else lay.rows
    out = s.new_empty((z, heads, out_rows * bs, n))
    if out.numel() == 0:
        return out
    groups = lay.groups(s.device, by_col=transposed)
    counts = torch.tensor(groups.counts, dtype=torch.int64, device=s.device)
    width = max(1, groups.tile.shape[1])
    tile = groups.tile if groups.tile.shape[1] else groups.tile.new_zeros((len(groups.counts), 1))
    other = groups.other if groups.other.shape[1] else tile
    grid = (len(groups.counts), z, triton.cdiv(n, _BLOCK_N))
    _spmm_kernel[grid](s.contiguous(), d, out, groups.ids, counts, tile.contiguous(), other.contiguous(), width,
                       out_rows, n, lay.nnz, *d.stride(), *out.stride(),
                       BS=bs, BLOCK_N=_BLOCK_N, TRANSPOSED=transposed)
    return out
