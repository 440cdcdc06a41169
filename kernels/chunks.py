"""Cache-sized batches of tensors: how the reference kernels (``reference.py``) and the
hand-written optimizers (``runtime.optim``) run a chain of elementwise ops.

An optimizer step is a chain of elementwise ops. Run with torch's ``_foreach`` kernels over whole
tensors, every op is one pass over main memory (a 20M-element Lion step: ~13 passes, ~110 ms
here). Running the whole chain on one ~256K-element piece at a time keeps the temporaries in
cache, so main memory sees each tensor about once (~33 ms, measured on this machine). Small
tensors are batched together so a model with many small parameters still pays few kernel calls.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import torch

__all__ = ["CHUNK_NUMEL", "chunked", "chunked_rows", "spans", "cuts", "unscaled"]

#: Elements per batch: 1 MiB per fp32 tensor, so the 3-5 tensors of a step fit in L2/L3.
CHUNK_NUMEL = 1 << 18


def chunked(tensor_lists: Sequence[Sequence[torch.Tensor]], chunk_numel: int = CHUNK_NUMEL
            ) -> Iterator[tuple[list[torch.Tensor], ...]]:
    """Yield aligned lists of views (one list per input list) of about ``chunk_numel`` elements.

    Args:
        tensor_lists: e.g. ``(params, grads, exp_avgs)``; the i-th tensors of all lists have the
            same shape. Views write through to the originals.
        chunk_numel: target elements per batch.

    Yields:
        A tuple with one list per input list; position j of every list is the same region.
    """
    for batch, _rows in chunked_rows(tensor_lists, chunk_numel):
        yield batch


def chunked_rows(tensor_lists: Sequence[Sequence[torch.Tensor]], chunk_numel: int = CHUNK_NUMEL
                 ) -> Iterator[tuple[tuple[list[torch.Tensor], ...], list[int]]]:
    """As ``chunked``, plus which input tensor (row) each view of the batch comes from."""
    batch: tuple[list[torch.Tensor], ...] = tuple([] for _ in tensor_lists)
    rows: list[int] = []
    size = 0
    for index, row in enumerate(zip(*tensor_lists, strict=True)):
        if not all(t.is_contiguous() for t in row):  # cannot slice a flat view: take it whole
            pieces = [tuple(row)]
        else:
            flats = [t.view(-1) for t in row]
            numel = flats[0].numel()
            pieces = [tuple(f[a:a + chunk_numel] for f in flats) for a in range(0, numel, chunk_numel)]
        for piece in pieces:
            for out, view in zip(batch, piece, strict=True):
                out.append(view)
            rows.append(index)
            size += piece[0].numel()
            if size >= chunk_numel:
                yield batch, rows
                batch, rows, size = tuple([] for _ in tensor_lists), [], 0
    if rows:
        yield batch, rows


def spans(numel: int, chunk_numel: int = CHUNK_NUMEL) -> Iterator[tuple[int, int]]:
    """``[a, b)`` ranges of ``chunk_numel`` elements (the last one shorter) covering ``numel``.

    Each starts at a multiple of ``chunk_numel`` (a multiple of any SIMD width), so an op run range
    by range takes the same vectorised or scalar path per element as on the whole tensor: an
    ``alpha``/``value`` op (fused multiply-add in torch's vector loop) gives the same bits.
    """
    return ((a, min(a + chunk_numel, numel)) for a in range(0, numel, chunk_numel))


def cuts(bounds: Sequence[int], a: int, b: int) -> list[tuple[int, int, int]]:
    """Where ``[a, b)`` meets the rows ``bounds`` (``FlatLayout.bounds``) delimits: ``(row, lo, hi)`` with
    ``lo``/``hi`` relative to ``a``; empty rows are left out."""
    out = []
    row = bisect.bisect_right(bounds, a) - 1
    while row < len(bounds) - 1 and bounds[row] < b:
        lo, hi = max(a, bounds[row]), min(b, bounds[row + 1])
        if hi > lo:
            out.append((row, lo - a, hi - a))
        row += 1
    return out


def unscaled(grads: list[torch.Tensor], inv_scale: float | None) -> list[torch.Tensor]:
    """Gradient pieces multiplied by ``inv_scale`` (a cache-sized copy; the originals stay)."""
    return grads if inv_scale is None or inv_scale == 1.0 else torch._foreach_mul(grads, inv_scale)
