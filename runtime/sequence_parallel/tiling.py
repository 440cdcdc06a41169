"""ALST's tiled computations (``deepspeed.runtime.sequence_parallel.ulysses_sp``): run a function
over slices of a long sequence so that only one slice's activations exist at a time.

- ``TiledMLP.apply(fn, module, x, shards, compute_params)``: ``fn(module, x)`` (an MLP) on slices of
  ``x`` along its second-to-last (sequence) dimension; nothing of the slices is kept for backward,
  which runs each slice's forward again and back-propagates it.
- ``sequence_tiled_compute(fn, seqlen, shards, kwargs_to_shard, kwargs_to_pass,
  grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction)``: the same
  for any ``fn(**kwargs)`` whose ``kwargs_to_shard`` are ``[batch, seq, ...]`` tensors; the slices'
  outputs are joined on ``output_unshard_dimension`` (0: one scalar per slice, e.g. a loss), then
  reduced (``None``, ``"mean"``, ``"sum"``).
- ``TiledFusedLogitsLoss.apply(fn, module, x, y, mask, shards, compute_params, output_reduction)``:
  ``fn(module, x, y[, mask])`` (LM head + loss) on slices of the flattened batch x sequence rows, so
  the whole ``[tokens, vocab]`` logits never exist; the slices' losses are averaged or summed.

``compute_params``: the weights ``fn`` uses. Each slice's backward adds to their gradients, so they
are marked ``ds_grad_is_ready = False`` until the last slice: the ZeRO gradient path reduces (and
stage 3 releases) a parameter only once its gradient is whole.

Differences from DeepSpeed 0.19.8:
- ``TiledFusedLogitsLoss`` runs its slices' backward in backward, not inside forward: DeepSpeed's
  (backward in forward, to save the second head forward) scales only ``x``'s gradient by the incoming
  gradient, so under fp16 loss scaling, or a loss multiplied after the call, the head's weight
  gradients come out wrong. Here every gradient is exact, at one more head forward per slice.
- A length that ``shards`` does not divide is cut as ``torch.chunk`` cuts it, and the slice count
  is the chunks there are (DeepSpeed's ``sequence_tiled_compute`` calls ``fn`` on empty slices in
  forward and fails in backward); ``"mean"`` averages over those slices.
- ``sequence_tiled_compute``'s ``"mean"``/``"sum"`` of a sequence-dimension output back-propagate
  correctly (DeepSpeed's backward narrows the reduced scalar's gradient and fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from dslaunch.errors import UsageError

__all__ = ["TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute", "sequence_tiled_compute"]

REDUCTIONS = (None, "mean", "sum")


def _slices(length: int, shards: int) -> list[tuple[int, int]]:
    """(start, length) of each slice, as ``torch.chunk(range(length), shards)`` cuts it."""
    if shards < 1:
        raise UsageError(f"tiled compute: shards must be at least 1, got {shards}")
    step = -(-length // shards) if length else 1
    return [(s, min(step, length - s)) for s in range(0, length, step)] or [(0, 0)]


@contextlib.contextmanager
def _gradient_whole_at_last(params: Sequence[torch.Tensor], last: bool) -> Iterator[None]:
    """Mark ``params`` as receiving only part of their gradient (all slices but the last)."""
    for p in params:
        p.ds_grad_is_ready = last
    try:
        yield
    finally:
        for p in params:
            p.ds_grad_is_ready = True


def _trainable(params: Iterable[torch.Tensor] | None) -> list[torch.Tensor]:
    return [p for p in (params or ()) if p.requires_grad]


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad)


def _backward_by_slices(source: torch.Tensor, dim: int, slices: list[tuple[int, int]], needs_grad: bool,
                        params: list[torch.Tensor],
                        run: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
    """Each slice of ``source`` (along ``dim``) in turn: ``run(i, piece)`` recomputes its output and
    gives that output's incoming gradient, which is back-propagated (into the weights' ``.grad``
    too, marked whole only at the last slice). Returns ``source``'s gradient, None if not needed."""
    source_grad = torch.zeros_like(source) if needs_grad else None
    for i, (s, n) in enumerate(slices):
        piece = _leaf(source.narrow(dim, s, n), needs_grad)
        with _gradient_whole_at_last(params, i == len(slices) - 1), torch.enable_grad():
            torch.autograd.backward(*run(i, piece))
        if source_grad is not None:
            source_grad.narrow(dim, s, n).copy_(piece.grad)
    return source_grad


class TiledMLP(torch.autograd.Function):
    """``fn(module, x)`` on slices of ``x`` along dimension -2, recomputed slice by slice in backward."""

    @staticmethod
    def forward(ctx, fn: Callable, module: Any, x: torch.Tensor, shards: int,
                compute_params: Iterable[torch.Tensor] | None = None) -> torch.Tensor:
        ctx.fn, ctx.module, ctx.shards, ctx.params = fn, module, shards, _trainable(compute_params)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return torch.cat([fn(module, x.narrow(-2, s, n)) for s, n in _slices(x.shape[-2], shards)], dim=-2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (x,) = ctx.saved_tensors
        slices = _slices(x.shape[-2], ctx.shards)

        def run(i: int, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ctx.fn(ctx.module, piece), grad.narrow(-2, *slices[i])

        x_grad = _backward_by_slices(x, -2, slices, ctx.needs_input_grad[2], ctx.params, run)
        return None, None, x_grad, None, None


def _reduce(output: torch.Tensor, reduction: str | None) -> torch.Tensor:
    if reduction not in REDUCTIONS:
        raise UsageError(f"tiled compute: output_reduction {reduction!r} is not one of None, 'mean', 'sum'")
    return output if reduction is None else output.mean() if reduction == "mean" else output.sum()


def _expand_grad(grad: torch.Tensor, shape: torch.Size, reduction: str | None) -> torch.Tensor:
    """The gradient of the joined (unreduced) output, from that of its reduction."""
    if reduction is None:
        return grad
    full = grad.expand(shape)
    return full / max(1, shape.numel()) if reduction == "mean" else full


def _join(outputs: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Dimension 0 stacks the slices' outputs (one loss per slice, as DeepSpeed); others concatenate."""
    return torch.stack(outputs) if dim == 0 else torch.cat(outputs, dim=dim)


class SequenceTiledCompute(torch.autograd.Function):
    """DeepSpeed's positional form: ``apply(fn, seqlen, shards, keys_to_shard, keys_to_pass,
    grad_requiring_tensor_key, compute_params, output_unshard_dimension, output_reduction, *args)``
    with ``args`` the values of ``keys_to_shard`` then ``keys_to_pass``; use ``sequence_tiled_compute``."""

    @staticmethod
    def forward(ctx, fn: Callable, seqlen: int, shards: int, keys_to_shard: list[str], keys_to_pass: list[str],
                grad_key: str, compute_params: Iterable[torch.Tensor] | None, dim: int, reduction: str | None,
                *args: Any) -> torch.Tensor:
        keys = [*keys_to_shard, *keys_to_pass]
        if grad_key not in keys_to_shard:
            raise UsageError(f"sequence_tiled_compute: grad_requiring_tensor_key {grad_key!r} is not one of "
                             f"kwargs_to_shard's keys {keys_to_shard}")
        ctx.fn, ctx.reduction, ctx.dim, ctx.params = fn, reduction, dim, _trainable(compute_params)
        ctx.keys_to_shard, ctx.values = keys_to_shard, dict(zip(keys, args, strict=True))
        ctx.grad_index, ctx.n_args = keys.index(grad_key), len(args)
        ctx.slices = _slices(seqlen, shards)
        outputs = []
        with torch.no_grad():
            for i in range(len(ctx.slices)):
                outputs.append(fn(**_slice_kwargs(ctx, i, ctx.values)))
        ctx.out_offsets = None if dim == 0 else _offsets([o.shape[dim] for o in outputs])
        joined = _join(outputs, dim)
        ctx.joined_shape = joined.shape
        return _reduce(joined, reduction)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        grad = _expand_grad(grad, ctx.joined_shape, ctx.reduction)
        key = list(ctx.values)[ctx.grad_index]

        def run(i: int, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = ctx.fn(**{**_slice_kwargs(ctx, i, ctx.values), key: piece})
            return out, grad[i] if ctx.dim == 0 else grad.narrow(ctx.dim, *ctx.out_offsets[i])

        source_grad = _backward_by_slices(ctx.values[key], 1, ctx.slices, ctx.needs_input_grad[9 + ctx.grad_index],
                                          ctx.params, run)
        grads: list[torch.Tensor | None] = [None] * ctx.n_args
        grads[ctx.grad_index] = source_grad
        return (None,) * 9 + tuple(grads)


def _slice_kwargs(ctx: Any, i: int, values: dict[str, Any]) -> dict[str, Any]:
    """Slice ``i``'s keyword arguments: the sharded ones cut on dimension 1, the others as given."""
    s, n = ctx.slices[i]
    return {k: (v.narrow(1, s, n) if k in ctx.keys_to_shard else v) for k, v in values.items()}


def _offsets(lengths: list[int]) -> list[tuple[int, int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return list(zip(starts, lengths, strict=True))


def sequence_tiled_compute(fn: Callable, seqlen: int, shards: int, kwargs_to_shard: dict[str, Any],
                           kwargs_to_pass: dict[str, Any], grad_requiring_tensor_key: str,
                           compute_params: Iterable[torch.Tensor] | None = None,
                           output_unshard_dimension: int = 1, output_reduction: str | None = "mean") -> torch.Tensor:
    """``fn(**kwargs)`` over ``shards`` slices of the sequence (dimension 1 of ``kwargs_to_shard``'s
    tensors), recomputed slice by slice in backward; ``grad_requiring_tensor_key`` names the sharded
    input whose gradient flows back (the others get none)."""
    return SequenceTiledCompute.apply(fn, seqlen, shards, list(kwargs_to_shard), list(kwargs_to_pass),
                                      grad_requiring_tensor_key, compute_params, output_unshard_dimension,
                                      output_reduction, *kwargs_to_shard.values(), *kwargs_to_pass.values())


class TiledFusedLogitsLoss(torch.autograd.Function):
    """``fn(module, x, y[, mask])`` on slices of the flattened ``[batch * seq]`` rows; the slices'
    losses averaged (``"mean"``) or summed (``"sum"``)."""

    @staticmethod
    def forward(ctx, fn: Callable, module: Any, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None,
                shards: int, compute_params: Iterable[torch.Tensor] | None = None,
                output_reduction: str = "mean") -> torch.Tensor:
        _check_logits_inputs(x, y, mask, output_reduction)
        ctx.fn, ctx.module, ctx.reduction, ctx.params = fn, module, output_reduction, _trainable(compute_params)
        ctx.x_shape = x.shape
        rows = [t.reshape(-1, *t.shape[2:]) if t is not None else None for t in (x, y, mask)]
        ctx.slices = _slices(rows[0].shape[0], shards)
        ctx.save_for_backward(*(t for t in rows if t is not None))
        ctx.has_mask = mask is not None
        with torch.no_grad():
            losses = torch.stack([fn(module, *_row_args(rows, s, n)) for s, n in ctx.slices])
        return _reduce(losses, output_reduction)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        x, y, *mask = ctx.saved_tensors
        rows = [x, y, mask[0] if ctx.has_mask else None]
        per_slice = grad / len(ctx.slices) if ctx.reduction == "mean" else grad

        def run(i: int, piece: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return ctx.fn(ctx.module, piece, *_row_args(rows[1:], *ctx.slices[i])), per_slice

        x_grad = _backward_by_slices(x, 0, ctx.slices, ctx.needs_input_grad[2], ctx.params, run)
        return None, None, None if x_grad is None else x_grad.view(ctx.x_shape), None, None, None, None, None


def _row_args(rows: list[torch.Tensor | None], s: int, n: int) -> list[torch.Tensor]:
    return [t.narrow(0, s, n) for t in rows if t is not None]


def _check_logits_inputs(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None, reduction: str) -> None:
    if reduction not in ("mean", "sum"):
        raise UsageError(f"TiledFusedLogitsLoss: output_reduction {reduction!r} is not 'mean' or 'sum'")
    if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
        raise UsageError(f"TiledFusedLogitsLoss: x {tuple(x.shape)} and y {tuple(y.shape)} must both be "
                         "[batch, seq, ...] with the same batch and sequence sizes")
    if mask is not None and mask.shape != x.shape[:2]:
        raise UsageError(f"TiledFusedLogitsLoss: mask {tuple(mask.shape)} must be [batch, seq] = {tuple(x.shape[:2])}")
