"""The global gradient norm's sums of squares, in one order whether a pass at the step takes them or
the gradients' last write into the shard does (the fold).

A group's gradient shard counts in units: each parameter's part of this rank's range, cut further
where another rank counts a parameter (``GroupLayout.counted_pieces``) and where the gradient
path writes the shard in separate pieces (its reduction buckets' edges, ``norm_cuts``), in order. A
unit's sum of squares is taken by ``sumsq`` (a pass over the shard) or by ``write_sumsq`` (the
write that puts the unit's final gradient into the shard: a copy or an add, then its sum while
the bytes are in cache); the two give the same bits for the same values, so a step whose
gradients were folded and one whose were not clip alike, and stages whose shards hold the same
values (stage 0 and stage 3 on one rank) take the same step. ``total`` adds the units' sums in
their order.

On the CPU the sums are the C kernel's (``kernels.cpu.ops.fold_sumsq``: double accumulation in
fixed blocks, the same bits at any thread count); elsewhere (a device, no compiler, or
``DSLAUNCH_KERNELS=reference``) torch's ``vector_norm`` in ``piece_dtype`` squared in double, per
unit.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from dslaunch.runtime.zero.partition import GroupLayout

__all__ = ["units", "sumsq", "write_sumsq", "total"]

Sum = float | torch.Tensor  # a Python float on the CPU kernel's path, a float64 scalar tensor elsewhere


def units(layout: GroupLayout, pieces: Sequence[tuple[int, int]] | None,
          cuts: Sequence[int] = ()) -> list[tuple[int, int, int]]:
    """(param index, lo, hi) of each non-empty unit of this rank's shard, relative to its start, in
    order; ``pieces``: the counted pieces (None: the whole range counts); ``cuts``: positions in
    the group's flat vector where units are cut too."""
    inner = sorted({c - layout.start for c in cuts if layout.start < c < layout.end})
    out = []
    for pi in range(len(layout.shapes)):
        a, b = layout.param_range(pi)
        lo, hi = max(a, layout.start) - layout.start, min(b, layout.end) - layout.start
        for pa, pb in ([(lo, hi)] if pieces is None else pieces):
            ua, ub = max(lo, pa), min(hi, pb)
            edges = [ua, *(c for c in inner if ua < c < ub), ub]
            out += [(pi, x, y) for x, y in itertools.pairwise(edges) if y > x]
    return out


@functools.cache
def _kernel() -> bool:
    """Whether the C kernel takes the sums: once per process (fold and pass must agree), and not
    under ``DSLAUNCH_KERNELS=reference``."""
    from dslaunch import kernels
    from dslaunch.kernels.cpu.build import available

    return kernels.mode() != "reference" and available()


def _on_kernel(t: torch.Tensor) -> bool:
    return t.is_cpu and t.dtype is torch.float32 and t.is_contiguous() and _kernel()


def sumsq(t: torch.Tensor, piece_dtype: torch.dtype = torch.float32) -> Sum:
    """The sum of squares of the fp32 gradient unit ``t``."""
    if _on_kernel(t):
        from dslaunch.kernels.cpu.ops import fold_sumsq

        return fold_sumsq(t)
    return torch.linalg.vector_norm(t, dtype=piece_dtype).double() ** 2


def write_sumsq(dst: torch.Tensor, src: torch.Tensor, add: bool, piece_dtype: torch.dtype = torch.float32) -> Sum:
    """``dst.copy_(src)`` (or ``dst.add_(src)``) and then ``sumsq(dst)``: in one pass on the CPU."""
    if _on_kernel(dst) and src.is_cpu and src.is_contiguous() and src.dtype in (torch.float32, torch.bfloat16,
                                                                               torch.float16):
        from dslaunch.kernels.cpu.ops import fold_sumsq

        return fold_sumsq(dst, src, "add" if add else "copy")
    dst.add_(src) if add else dst.copy_(src)
    return sumsq(dst, piece_dtype)


def total(sums: Sequence[Sum], device: torch.device) -> torch.Tensor:
    """The units' sums added (double), a float64 scalar on ``device``: in order on the CPU kernel's
    floats, in one reduction over a device's tensors (one launch, not one per unit)."""
    if sums and all(isinstance(s, torch.Tensor) for s in sums):
        return torch.stack(list(sums)).sum().to(device)
    acc: Sum = 0.0
    for s in sums:
        acc = acc + s
    return torch.as_tensor(acc, dtype=torch.float64, device=device)
