"""What the hand-written optimizers (Lion, Lamb, Adam) share: a base class, cache-sized batches.

An optimizer step is a chain of elementwise ops. Run with torch's ``_foreach`` kernels over whole
tensors, every op is one pass over main memory (a 20M-element Lion step: ~13 passes, ~110 ms
here). Running the whole chain on one ~256K-element piece at a time keeps the temporaries in
cache, so main memory sees each tensor about once (~33 ms, measured on this machine). Small
tensors are batched together so a model with many small parameters still pays few kernel calls.

``ChunkedOptimizer`` holds the torch ``step()`` protocol (closure, params with gradients, sparse
check, and torch's AMP protocol: a ``grad_scale`` the gradients are divided by inside the update,
a ``found_inf`` that skips it) and lazily created per-parameter state; subclasses write only
their update, reading gradients through ``_unscaled`` (or handing ``_inv_scale`` to a kernel from
``dslaunch.kernels``, whose reference does the same with ``unscaled``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["CHUNK_NUMEL", "chunked", "chunked_rows", "spans", "cuts", "unscaled", "ChunkedOptimizer"]

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


class ChunkedOptimizer(torch.optim.Optimizer):
    """Base class: ``step()`` calls ``_update_group`` for each group with the params that have grads.

    Class attributes:
        chunk_numel: elements per cache-sized batch (``chunked``).
        moment_keys: per-parameter state tensors, created as zeros shaped like the parameter.
        counts_steps: keep a per-parameter ``step`` (0-dim float tensor, as torch's Adam).
    """

    chunk_numel: int = CHUNK_NUMEL
    moment_keys: tuple[str, ...] = ("exp_avg",)
    counts_steps: bool = False
    # torch's AMP protocol (GradScaler, the ZeRO strategies): set ``grad_scale``/``found_inf``
    # before step(); unscaling happens on cache-sized pieces instead of a separate pass.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D401 - torch API
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and float(found_inf) != 0.0:
            return loss  # the scaler saw inf/nan: skip, as torch's fused optimizers do
        grad_scale = getattr(self, "grad_scale", None)
        self._inv_scale = None if grad_scale is None else 1.0 / float(grad_scale)
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            if params:
                self._update_group(index, group, params)
        return loss

    def _update_group(self, index: int, group: dict[str, Any], params: list[torch.Tensor]) -> None:
        raise NotImplementedError

    def _unscaled(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradient pieces divided by ``grad_scale`` (a cache-sized copy; the originals stay)."""
        return unscaled(grads, getattr(self, "_inv_scale", None))

    def _state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """This parameter's state, created on first use."""
        state = self.state[p]
        if not state:
            if self.counts_steps:
                state["step"] = torch.tensor(0.0)
            for key in self.moment_keys:
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _count_step(self, p: torch.Tensor) -> int:
        """Advance this parameter's step counter; returns the new count."""
        state = self._state(p)
        # Out of place: a loaded state_dict may share this tensor with another optimizer.
        state["step"] = state["step"] + 1
        return int(state["step"].item())
