"""DeepSpeed's ``deepspeed.sequence.linear_cross_entropy``: the cross-entropy of a
vocabulary-parallel LM head's output, ``hidden @ weight.T (+ bias)``, without the logits.

A vocabulary-split head still makes ``[tokens, vocabulary / tp]`` logits on every rank, the largest
activation of a long-context step. Here the projection is fused into the loss: forward takes the
tokens in chunks and keeps, per token, only its local max, sum of exps and target logit (three
per-token all-reduces over the tensor group, after every chunk, so their count never depends on the
shard); backward makes the logits again one vocabulary block at a time, each block's weight
gradient one matmul over all tokens. Peak extra memory is one fp32 block (by default about the
size of ``hidden``), whatever the vocabulary. ``hidden`` is the same on every tensor rank (as
before a column-parallel layer), so its gradient is the sum of the ranks' partial ones (fp32).

collective: every rank of ``tp_group`` and ``sp_group`` (none without them).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.sequence_parallel.cross_entropy import (
    group_reduce,
    is_parallel,
    resolve_vocab_shard,
    sequence_sum,
)

__all__ = ["vocab_parallel_linear_cross_entropy"]

_REDUCTIONS = ("none", "sum", "mean")


def _default_chunk(tokens: int, vocabulary: int, tp_size: int, hidden_size: int) -> int:
    """Tokens per chunk so that one fp32 logits chunk is about ``hidden``'s size. From the global
    layout (the widest shard), so every rank takes the same chunks, uneven shards too."""
    widest = math.ceil(vocabulary / tp_size)
    return max(1, math.ceil(tokens / max(1, math.ceil(widest / hidden_size))))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on, else the inputs' common one."""
    kind = hidden.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    out = (hidden.to(dtype) @ weight.to(dtype).t()).float()
    return out if bias is None else out + bias.float()


class _LinearCrossEntropy(torch.autograd.Function):
    """Per-token losses ``[N]`` (0 where ignored) of ``hidden [N, H]`` through ``weight [V, H]``."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                target: torch.Tensor, group: Any, vocab_start: int, keep: torch.Tensor, chunk: int,
                dtype: torch.dtype) -> torch.Tensor:
        local = target - vocab_start
        mine = keep & (local >= 0) & (local < weight.shape[0])
        local = local.masked_fill(~mine, 0)
        n = hidden.shape[0]
        peak, shift, total, picked = (torch.empty(n, device=hidden.device) for _ in range(4))
        for start in range(0, n, chunk):
            rows = slice(start, start + chunk)
            logits = _logits(hidden[rows], weight, bias, dtype)
            peak[rows] = logits.amax(dim=-1)
            # a shard all -inf on a row (a masked padding of the vocabulary) adds nothing
            shift[rows] = torch.where(torch.isfinite(peak[rows]), peak[rows], 0.0)
            total[rows] = (logits - shift[rows, None]).exp().sum(dim=-1)
            picked[rows] = logits.gather(-1, local[rows, None]).squeeze(-1)
        # one agreed max; each rank's sum of exps rescaled to it; the target logit is one rank's
        group_reduce(peak, group, dist.ReduceOp.MAX)
        both = group_reduce(torch.stack([total * (shift - peak).exp(), picked.masked_fill(~mine, 0.0)]), group)
        log_z = peak + both[0].log()
        ctx.save_for_backward(hidden, weight, bias, log_z, local, mine, keep)
        ctx.group, ctx.chunk, ctx.dtype = group, chunk, dtype
        return (log_z - both[1]) * keep

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, log_z, local, mine, keep = ctx.saved_tensors
        grad = (grad * keep).float()
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        grad_bias = None if bias is None else torch.empty(bias.shape, dtype=torch.float32, device=bias.device)
        tokens = torch.arange(hidden.shape[0], device=hidden.device)
        for start in range(0, weight.shape[0], ctx.chunk):
            cols = slice(start, start + ctx.chunk)
            block = _logits(hidden, weight[cols], None if bias is None else bias[cols], ctx.dtype)
            block = (block - log_z[:, None]).exp()  # softmax minus the target's one-hot, per token
            here = mine & (local >= start) & (local < start + block.shape[1])
            block[tokens[here], local[here] - start] -= 1.0
            block *= grad[:, None]
            grad_weight[cols] = (block.t().to(ctx.dtype) @ hidden.to(ctx.dtype)).float()
            grad_hidden += (block.to(ctx.dtype) @ weight[cols].to(ctx.dtype)).float()
            if grad_bias is not None:
                grad_bias[cols] = block.sum(dim=0)
        group_reduce(grad_hidden, ctx.group)  # each rank saw its vocabulary only: partial sums (fp32: no overflow)
        return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None, None, None)


def vocab_parallel_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                        bias: torch.Tensor | None = None, tp_group: Any = None, sp_group: Any = None,
                                        vocab_start_index: int | None = None, vocab_end_index: int | None = None,
                                        ignore_index: int = -100, reduction: str = "mean",
                                        chunk_size: int | None = None) -> torch.Tensor:
    """The cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target``, logits never made whole.

    ``weight`` (``[local vocabulary, hidden]``) and ``bias`` are this rank's rows of a
    vocabulary-parallel LM head; ``hidden`` (``[..., hidden]``) is the same on every tensor rank.
    ``chunk_size``: tokens per forward chunk, and vocabulary rows per backward block (default: one
    fp32 block about as large as ``hidden``). ``reduction``: ``"none"`` per-token losses shaped as
    ``target`` (0 where ignored, not summed over ``sp_group``), ``"sum"`` their sum over the
    sequence group, ``"mean"`` that sum over the counted tokens of the sequence group.

    Raises:
        ValueError: an unknown reduction, shapes that do not match, bounds given alone or not tiling
            the vocabulary, a non-positive ``chunk_size``, a target outside the vocabulary.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} must match outside "
                         "the hidden dimension")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [local vocabulary, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    start, _, vocabulary = resolve_vocab_shard(weight.shape[0], vocab_start_index, vocab_end_index, tp_group,
                                               hidden.device)
    flat = target.reshape(-1).long()
    keep = flat != ignore_index
    if bool((keep & ((flat < 0) | (flat >= vocabulary))).any()):
        raise ValueError(f"target holds ids outside the vocabulary [0, {vocabulary})")
    rows = hidden.reshape(-1, hidden.shape[-1])
    if chunk_size is None:
        tp_size = dist.get_world_size(tp_group) if is_parallel(tp_group) else 1
        chunk_size = _default_chunk(rows.shape[0], vocabulary, tp_size, rows.shape[1])
    dtype = _compute_dtype(hidden, weight)
    with torch.autocast(hidden.device.type, enabled=False):
        losses = _LinearCrossEntropy.apply(rows, weight, bias, flat, tp_group, start, keep, chunk_size, dtype)
    if reduction == "none":
        return losses.view(target.shape)
    total = losses.sum()
    if reduction == "mean":
        total = total / group_reduce(keep.sum().float(), sp_group).clamp_min(1.0)
    return sequence_sum(total, sp_group)
