"""The sequence all-gather of AutoSP: every rank's shard of a sequence, concatenated in rank order,
with shards of different lengths (``num_patches`` that the group does not divide).

AutoSP's wrappers (``vit_attention.py``, ``fusion.py``) run a module they cannot see into (a
vision attention, a projector) on the whole sequence on every rank and keep their own slice of the
result; so unlike Ulysses' all-to-all (``layout.py``) the gather is of the activations, not of
heads. Each rank's loss then reaches every rank's positions: the backward sums the gradient over
the ranks and returns each rank the rows of its own shard (DeepSpeed 0.19.8's gather has no
backward, so there the layers before a wrapped attention get no gradient through it).

The bytes move through ``tensor_parallel.collectives.gather_last_dim`` (zero-padded to the longest
shard, as gloo needs equal sizes), the one variable-width all-gather of dslaunch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch.errors import UsageError
from dslaunch.runtime.tensor_parallel.collectives import gather_last_dim

__all__ = ["ShardLayout", "gather_sequence", "shard_layout"]


@dataclass(frozen=True)
class ShardLayout:
    """How a sequence is split over a group: ``lengths[r]`` positions at rank ``r``, in rank
    order; ``rank`` is this rank."""

    lengths: tuple[int, ...]
    rank: int

    @property
    def start(self) -> int:
        """This rank's first position in the whole sequence."""
        return sum(self.lengths[:self.rank])

    @property
    def length(self) -> int:
        """This rank's number of positions."""
        return self.lengths[self.rank]


_MAX_DIMS = 8  # the shape exchange is one fixed-size tensor, so no rank can wait on a bigger one


def _described(x: torch.Tensor) -> torch.Tensor:
    """``x``'s dtype (a checksum of its name: the same in every process), rank and first
    ``_MAX_DIMS`` sizes, in a tensor of one size whatever ``x`` is."""
    sizes = list(x.shape[:_MAX_DIMS])
    return torch.tensor([zlib.crc32(str(x.dtype).encode()), x.dim(), *sizes, *[0] * (_MAX_DIMS - len(sizes))],
                        dtype=torch.long)


def shard_layout(x: torch.Tensor, dim: int, group: Any, what: str) -> ShardLayout:
    """Every rank's length of ``x`` on ``dim``, checking that the dtypes and the other dimensions
    agree (every rank raises the same line, so none is left waiting in a collective).

    collective: every rank of ``group``.

    Raises:
        UsageError: the ranks' tensors differ in dtype or outside ``dim`` (naming ``what`` and
            rank 0's and the first differing rank's shapes), or have more than 8 dimensions.
    """
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = _described(x)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    if any(int(d[1]) > _MAX_DIMS for d in everyone):
        raise UsageError(f"{what}: a tensor of more than {_MAX_DIMS} dimensions on some rank; at most "
                         f"{_MAX_DIMS} are supported")
    kinds = [(int(d[0]), tuple(d[2:2 + int(d[1])].tolist())) for d in everyone]
    dim, (dtype, first) = dim % x.dim(), kinds[0]
    for r, (theirs_dtype, theirs) in enumerate(kinds):  # against rank 0: every rank raises the same line
        if theirs_dtype != dtype or theirs[:dim] + theirs[dim + 1:] != first[:dim] + first[dim + 1:]:
            raise UsageError(f"{what}: the ranks of the sequence group must hold shards of one dtype that differ "
                             f"only in the sequence dimension {dim}; rank 0 has {first}, rank {r} has {theirs}"
                             + ("" if theirs_dtype == dtype else " (and another dtype)"))
    return ShardLayout(tuple(shape[dim] for _, shape in kinds), rank)


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, layout: ShardLayout, group: Any) -> torch.Tensor:
        ctx.dim, ctx.layout, ctx.group = dim, layout, group
        return gather_last_dim(x.movedim(dim, -1), list(layout.lengths), group).movedim(-1, dim).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        import torch.distributed as dist

        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        mine = total.narrow(ctx.dim, ctx.layout.start, ctx.layout.length)
        return mine.contiguous(), None, None, None


def gather_sequence(x: torch.Tensor, dim: int, group: Any, what: str) -> tuple[torch.Tensor, ShardLayout]:
    """The whole sequence (every rank's ``x`` concatenated on ``dim`` in rank order) and the layout
    of the shards. Differentiable: the gradient of a rank's shard is the sum over the ranks of the
    gradient of its positions.

    collective: every rank of ``group``, forward and backward.

    Raises:
        UsageError: the ranks' tensors differ outside ``dim``.
    """
    layout = shard_layout(x, dim, group, what)
    return _GatherSequence.apply(x, dim % x.dim(), layout, group), layout
