"""Cache-sized batches of tensor views for the hand-written optimizers (Lion, Lamb, Adam).

An optimizer step is a chain of elementwise ops. Run with torch's ``_foreach`` kernels over whole
tensors, every op is one pass over main memory (a 20M-element Lion step: ~13 passes, ~110 ms
here). Running the whole chain on one ~256K-element piece at a time keeps the temporaries in
cache, so main memory sees each tensor about once (~33 ms, measured on this machine). Small
tensors are batched together so a model with many small parameters still pays few kernel calls.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

__all__ = ["CHUNK_NUMEL", "chunked"]

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
    batch: tuple[list[torch.Tensor], ...] = tuple([] for _ in tensor_lists)
    size = 0
    for row in zip(*tensor_lists, strict=True):
        if not all(t.is_contiguous() for t in row):  # cannot slice a flat view: take it whole
            pieces = [tuple(row)]
        else:
            flats = [t.view(-1) for t in row]
            numel = flats[0].numel()
            pieces = [tuple(f[a:a + chunk_numel] for f in flats) for a in range(0, numel, chunk_numel)]
        for piece in pieces:
            for out, view in zip(batch, piece, strict=True):
                out.append(view)
            size += piece[0].numel()
            if size >= chunk_numel:
                yield batch
                batch, size = tuple([] for _ in tensor_lists), 0
    if batch[0]:
        yield batch
