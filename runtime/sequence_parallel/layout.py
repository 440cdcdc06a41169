"""Moving attention tensors between the sequence-sharded and the head-sharded layout (Ulysses).

Outside attention each of the ``P`` ranks of a sequence group holds ``1/P`` of the sequence and
every head; attention needs the whole sequence, so around it each rank holds every position of
``1/P`` of the heads. One all-to-all moves between the two: a rank cuts its tensor into ``P``
chunks on the dimension it gives up (``scatter_dim``), sends chunk ``j`` to rank ``j`` and
concatenates what it receives, in rank order, on the dimension it completes (``gather_dim``).
The move is a permutation of the group's elements, so its gradient is the inverse move (the two
dimensions swapped): ``seq_all_to_all`` is differentiable.

Grouped-query attention with fewer key/value heads than ranks (or a count ``P`` does not
divide) is handled by ``replicate_kv_heads``: each key/value head is repeated so that every rank
receives whole groups.

gloo implements ``all_to_all_single`` on CPU tensors (the list form is not used), as NCCL does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dslaunch.errors import UsageError

__all__ = ["seq_all_to_all", "kv_replication", "replicate_kv_heads"]


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world == 1:
        return x
    if x.shape[scatter_dim] % world:
        raise UsageError(f"sequence parallelism: dimension {scatter_dim} of a {tuple(x.shape)} tensor does not "
                         f"split into {world} equal parts (one per rank of the sequence group)")
    send = torch.stack(x.chunk(world, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """``x`` split on ``scatter_dim`` over the ranks of ``group`` and completed on ``gather_dim``.

    From the sequence layout to the head layout: ``scatter_dim`` is the head dimension and
    ``gather_dim`` the sequence dimension; back: the other way round. Differentiable.

    collective: every rank of ``group``, tensors of one shape.

    Raises:
        UsageError: ``x.shape[scatter_dim]`` is not a multiple of the group's size.
    """
    return _SeqAllToAll.apply(x, group, scatter_dim, gather_dim)


def kv_replication(heads: int, kv_heads: int, ranks: int) -> int:
    """How many times each key/value head must be repeated for ``ranks`` to split them into whole
    query groups: 1 when ``ranks`` divides ``kv_heads``, else ``ranks / gcd(kv_heads, ranks)``.

    After repeating, ``kv_heads * factor`` is a multiple of ``ranks``, and query head ``q`` (of
    group ``q * kv_heads // heads``) lands on the rank that holds its key/value head.

    Raises:
        UsageError: ``ranks`` does not divide ``heads``, or ``kv_heads`` does not divide ``heads``.
    """
    if heads % ranks:
        raise UsageError(f"sequence parallelism: {heads} attention heads do not split over a sequence group of "
                         f"{ranks} ranks; the head count must be a multiple of sequence_parallel_size")
    if kv_heads < 1 or heads % kv_heads:
        raise UsageError(f"sequence parallelism: {kv_heads} key/value heads do not divide {heads} query heads")
    return ranks // math.gcd(kv_heads, ranks)


def replicate_kv_heads(x: torch.Tensor, factor: int, head_dim: int) -> torch.Tensor:
    """``x`` with each head on ``head_dim`` repeated ``factor`` times in place (neighbours), as
    grouped-query attention expands them; the gradient sums the copies."""
    return x if factor == 1 else x.repeat_interleave(factor, dim=head_dim)
