"""Layout-invariant AutoTP training (``{"layout_invariant": {"enabled": true, "chunks": C}}``): the
sharded Linears compute the same bits at every tensor-parallel degree that divides ``C``.

A matmul's inner dimension summed in pieces cut by the degree, then all-reduced, rounds
differently at each degree (fp32 addition is not associative). Here every dimension the degree
splits is cut into ``C`` fixed pieces, whatever the degree: each piece is its own matmul (the same
shapes at every degree, so BLAS sums each the same way), and where pieces must be added their
results are gathered from the tensor group (not all-reduced) and added in one pairwise tree over
the global piece index, ``((p0 + p1) + (p2 + p3))``:

- row-parallel forward: the partial outputs of the ``C`` input-feature pieces;
- column-parallel backward: the input gradient's parts from the ``C`` output-feature pieces.

Attention: the plain-torch model's SDPA over a rank's heads is the same bits at H/tp as at H heads
(measured); Hugging Face's eager attention is not (its kernels see other head counts and strides),
so a Hugging Face model's attention runs one KV head at a time (``fix_attention_pieces``).

The weight gradients are per-piece products of the same shapes at every degree: no sum. The
vocab-parallel embedding needs nothing (its sum adds zeros), nor do the gathered logits.

Limitations: fp32 only; not with ``tensor_parallel.loss_parallel`` (its softmax sums over the
vocabulary slices); every segment a rank holds must divide into ``C / tp`` pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.comm import comm
from dslaunch.runtime.tensor_parallel.auto_tp import Segments

__all__ = ["Pieces", "tree_sum", "column_linear", "row_linear", "fix_attention_pieces"]


@dataclass(frozen=True)
class Pieces:
    """A dimension the tensor group splits, cut into ``chunks`` pieces per segment: this rank holds
    ``chunks / size`` consecutive pieces of each of its segments (``widths``: theirs, the same on
    every rank). ``of(segments)`` gives a layer's; ``local()`` refuses widths that do not divide."""

    group: Any
    size: int  # the tensor-parallel degree
    chunks: int
    widths: tuple[int, ...] = ()

    def of(self, segments: Segments) -> Pieces:
        """These pieces for a layer holding ``segments`` ([start, stop) ranges) of the dimension.

        Raises:
            ConfigError: a segment that does not divide into ``chunks / size`` pieces.
        """
        cut = replace(self, widths=tuple(b - a for a, b in segments))
        cut.local()
        return cut

    def local(self) -> list[tuple[int, int]]:
        """[start, stop) of this rank's pieces in its local dimension, segment by segment."""
        per, out, start = self.chunks // self.size, [], 0
        for width in self.widths:
            if width % per:
                raise ConfigError(f"{self.chunks} does not cut a layer evenly: a rank's slice of {width} features "
                                  f"does not divide into {per} pieces; use a chunks whose pieces divide the "
                                  "model's widths", key="layout_invariant.chunks")
            step = width // per
            out += [(start + i * step, start + (i + 1) * step) for i in range(per)]
            start += width
        return out

    def sum(self, parts: torch.Tensor) -> torch.Tensor:
        """The sum over every rank's ``parts`` (``[pieces on this rank, ...]``) in the global
        piece order (segment, then position in it), as one pairwise tree.

        collective: every rank of ``group``, with ``parts`` of the same shape.
        """
        if self.size > 1:
            gathered = [torch.empty_like(parts) for _ in range(self.size)]
            comm.all_gather(gathered, parts.contiguous(), group=self.group)
            parts = torch.cat(gathered)
        per = self.chunks // self.size  # rank-major (rank, segment, piece) -> (segment, rank, piece)
        order = parts.unflatten(0, (self.size, len(self.widths), per)).transpose(0, 1).flatten(0, 2)
        return tree_sum(list(order.unbind(0)))


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + (p2 + p3)) + ...``: neighbours added level by level (an odd last one is
    carried up): one fixed order for a fixed number of parts."""
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
    return parts[0]


def _cut(t: torch.Tensor, ranges: list[tuple[int, int]], dim: int) -> list[torch.Tensor]:
    """Contiguous copies of ``t``'s ranges along ``dim``: BLAS then sees the same layout at any degree."""
    return [t.narrow(dim, a, b - a).contiguous() for a, b in ranges]


class _Column(torch.autograd.Function):
    """``y = x @ W^T + b`` piece by output-feature piece; backward sums the input gradient's parts
    over the group's pieces in the fixed tree."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                pieces: Pieces) -> torch.Tensor:
        ranges = pieces.local()
        flat = x.reshape(-1, x.shape[-1])
        biases = [None] * len(ranges) if bias is None else _cut(bias, ranges, 0)
        out = torch.cat([torch.nn.functional.linear(flat, w, b)
                         for w, b in zip(_cut(weight, ranges, 0), biases, strict=True)], dim=-1)
        ctx.save_for_backward(flat, weight)
        ctx.pieces, ctx.ranges, ctx.shape = pieces, ranges, x.shape
        ctx.has_bias = bias is not None
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        flat, weight = ctx.saved_tensors
        g = _cut(grad.reshape(-1, grad.shape[-1]), ctx.ranges, 1)
        w = _cut(weight, ctx.ranges, 0)
        grad_x = ctx.pieces.sum(torch.stack([gp @ wp for gp, wp in zip(g, w, strict=True)]))
        grad_w = torch.cat([gp.t() @ flat for gp in g])
        grad_b = torch.cat([gp.sum(0) for gp in g]) if ctx.has_bias else None
        return grad_x.view(ctx.shape), grad_w, grad_b, None


class _Row(torch.autograd.Function):
    """``y = sum over pieces of x_p @ W_p^T`` (input-feature pieces, the fixed tree over the group);
    backward: each piece's input and weight gradient, no sum."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, pieces: Pieces) -> torch.Tensor:
        ranges, flat = pieces.local(), x.reshape(-1, x.shape[-1])
        xs = _cut(flat, ranges, 1)
        partial = torch.stack([xp @ wp.t() for xp, wp in zip(xs, _cut(weight, ranges, 1), strict=True)])
        ctx.save_for_backward(weight, flat)  # not the pieces: cut again backward, no second copy kept
        ctx.ranges, ctx.shape = ranges, x.shape
        return pieces.sum(partial).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        weight, flat = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).contiguous()
        grad_x = torch.cat([g @ wp for wp in _cut(weight, ctx.ranges, 1)], dim=-1)
        grad_w = torch.cat([g.t() @ xp for xp in _cut(flat, ctx.ranges, 1)], dim=1)
        return grad_x.view(ctx.shape), grad_w, None


def column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, pieces: Pieces) -> torch.Tensor:
    """This rank's output features of ``x @ W^T + b`` (``pieces``: of the output features), with
    the input gradient summed over the group in the fixed tree.

    collective (backward): every rank of the tensor group."""
    return _Column.apply(x, weight, bias, pieces)


def row_linear(x: torch.Tensor, weight: torch.Tensor, pieces: Pieces) -> torch.Tensor:
    """``x @ W^T`` summed over the group's input-feature pieces in the fixed tree (no bias).

    collective: every rank of the tensor group."""
    return _Row.apply(x, weight, pieces)


def fix_attention_pieces(model: nn.Module) -> None:
    """A Hugging Face model's attention run one KV head (and its query heads) at a time, whatever
    the degree: its kernels otherwise see other head counts and strides at each degree (measured:
    eager attention at 2 query heads over 1 KV head rounds apart from 4 over 2, 1.5e-8). Registered
    in Hugging Face's attention functions as ``dslaunch_layout_invariant|<the model's own>``. A model
    without Hugging Face's attention dispatch (``config._attn_implementation``) is left as it is.
    """
    inner = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if inner is None or inner.startswith("dslaunch_layout_invariant|"):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"dslaunch_layout_invariant|{inner}"
    AttentionInterface.register(name, partial(_attention_by_kv_head, inner))
    if inner in ALL_MASK_ATTENTION_FUNCTIONS:  # else Hugging Face builds no mask for the new name
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    for sub in model.modules():  # every config the attention modules read (a composite model's too)
        cfg = getattr(sub, "config", None)
        if getattr(cfg, "_attn_implementation", None) == inner:
            cfg._attn_implementation = name


def _attention_by_kv_head(inner: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: torch.Tensor | None,
                          **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The ``inner`` attention once per KV head, on contiguous copies: the same shapes and strides
    at every degree. Returns ``[batch, seq, heads, dim]`` (Hugging Face's layout), no weights."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    run = ALL_ATTENTION_FUNCTIONS.get_interface(inner, sys.modules[type(module).__module__].eager_attention_forward)
    kv, group = key.shape[1], query.shape[1] // key.shape[1]
    outs = [run(module, query[:, i * group:(i + 1) * group].contiguous(), key[:, i:i + 1].contiguous(),
                value[:, i:i + 1].contiguous(), attention_mask, **kwargs)[0] for i in range(kv)]
    return torch.cat(outs, dim=2), None
