"""The collectives the sharded layers call, for inference and for training.

A layer holds a ``Collectives`` and calls three functions of it:

- ``enter(x)``: where a column-parallel layer (or the vocab-parallel output layer) takes its whole
  input. Identity forward; in training its backward sums the input gradient over the group (each
  rank's slice of the weight gives a part of it: Megatron's "f").
- ``all_reduce(t)``: the sum of partial results (row-parallel output, vocab-parallel embedding).
  In training the backward is the identity: every rank needs the whole output's gradient as it
  is (Megatron's "g").
- ``gather(local, widths)``: the vocab-parallel logits, concatenated over the last dimension in
  rank order (``widths``: every rank's width, uneven when the vocabulary does not divide). In
  training the backward keeps this rank's slice of the gradient.

``inference_collectives(group)`` works in place, without autograd (what ``init_inference`` uses
when the shared-memory all-reduce does not apply); ``training_collectives(group)`` goes through
autograd functions.

collective: every function of a group's ``Collectives`` runs on every rank of the group, with
tensors of the same shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from dslaunch.errors import UsageError
from dslaunch.runtime.comm import comm

__all__ = ["Collectives", "NO_COLLECTIVES", "inference_collectives", "training_collectives", "gather_last_dim",
           "inputs_agree", "check_first_inputs"]

Gather = Callable[[torch.Tensor, list[int]], torch.Tensor]


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Collectives:
    """What the sharded layers call (see the module docstring)."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    gather: Gather  # (local slice, every rank's width) -> concatenated over the last dimension
    name: str
    enter: Callable[[torch.Tensor], torch.Tensor] = _identity
    pieces: Any = None  # layout-invariant training: the ``invariant.Pieces`` the column/row layers cut by


NO_COLLECTIVES = Collectives(_identity, lambda t, widths: t, "none")
"""A group of one rank: nothing to exchange."""


def gather_last_dim(local: torch.Tensor, widths: list[int], group: Any) -> torch.Tensor:
    """Every rank's ``local`` concatenated over the last dimension, in rank order.

    collective: every rank of ``group``.
    """
    padded = F.pad(local, (0, max(widths) - local.shape[-1])).contiguous()  # gloo needs equal sizes
    parts = [torch.empty_like(padded) for _ in widths]
    comm.all_gather(parts, padded, group=group)
    return torch.cat([p[..., :w] for p, w in zip(parts, widths, strict=True)], dim=-1)


def inference_collectives(group: Any) -> Collectives:
    """In-place collectives over ``group`` (no autograd), as ``dslaunch.comm`` runs them."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        comm.inference_all_reduce(t, group=group)
        return t

    return Collectives(reduce, lambda local, widths: gather_last_dim(local, widths, group), "torch.distributed")


class _Enter(torch.autograd.Function):
    """Identity forward; the input gradient summed over the group backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _Sum(torch.autograd.Function):
    """The sum over the group forward; the gradient as it is backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """Concatenation over the last dimension forward; this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, widths: list[int], group: Any) -> torch.Tensor:
        rank = torch.distributed.get_rank(group)
        ctx.start, ctx.stop = sum(widths[:rank]), sum(widths[:rank + 1])
        return gather_last_dim(local, widths, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[..., ctx.start:ctx.stop].contiguous(), None, None


def training_collectives(group: Any) -> Collectives:
    """The collectives over ``group`` with their backward collectives (autograd functions)."""
    return Collectives(lambda t: _Sum.apply(t, group), lambda local, widths: _Gather.apply(local, widths, group),
                       "torch.distributed (training)", lambda x: _Enter.apply(x, group))


def _fingerprint(values: Any, with_rng: bool) -> torch.Tensor:
    """A fixed-size summary of the tensors (shapes, dtypes, contents) and optionally the RNG state:
    the same size on every rank whatever the inputs, so comparing it can never hang."""
    h = hashlib.blake2b(digest_size=16)
    for leaf in tree_flatten(values)[0]:
        if isinstance(leaf, torch.Tensor):
            h.update(f"{tuple(leaf.shape)}{leaf.dtype}".encode())
            h.update(leaf.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())  # 0-d too
        elif isinstance(leaf, (int, float, bool, str, type(None))):
            h.update(repr(leaf).encode())
    if with_rng:
        h.update(torch.get_rng_state().numpy().tobytes())
    digest = h.digest()
    return torch.tensor([int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)], dtype=torch.float64)


def inputs_agree(values: Any, group: Any, with_rng: bool = False) -> bool:
    """Whether every rank of ``group`` holds the same ``values`` (tensors by shape, dtype and
    content; plain scalars by value) and, with ``with_rng``, the same torch RNG state. Compares a
    fixed-size fingerprint, so ranks with different shapes get False, never a hang.

    collective: every rank of ``group``.
    """
    mine = _fingerprint(values, with_rng)
    high, low = mine.clone(), mine.clone()
    comm.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    comm.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    return bool(torch.equal(high, low))


def check_first_inputs(values: Any, group: Any) -> None:
    """AutoTP training's first batch must be the same on every tensor slice (as DeepSpeed checks
    it): slices fed different samples would train a model no rank computes.

    collective: every rank of ``group``.

    Raises:
        UsageError: the ranks of ``group`` got different inputs.
    """
    if not inputs_agree(values, group):
        raise UsageError("tensor_parallel.autotp_size: the tensor-parallel ranks of one replica got different "
                         "inputs in their first forward; every slice must read the same batch (use the "
                         "engine's data loader, or index your data by engine.grid.get_data_parallel_rank())")
