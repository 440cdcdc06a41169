"""MoE beside tensor parallelism: the tensor slices of a replica see the same tokens, so before the
expert all-to-all each keeps only its share of every expert's slots and after it they gather them
back (DeepSpeed's ``deepspeed.moe.mappings.drop_tokens`` / ``gather_tokens``, which read the
tensor group of ``deepspeed.utils.groups.mpu``: so do these without ``slices``).

``TensorSlices`` is what a ``MOELayer`` knows of the tensor group: its process group, size, this
rank's index, and whether the experts themselves are tensor-sliced
(``enable_expert_tensor_parallelism``: then each slice runs every slot, gathered, through its
part of the expert, and keeps its share of the outputs again).

Each function's gradient is the other's: a dropped share's gradient is gathered, a gathered
tensor's gradient keeps this rank's share (the slices' gradients of the replicated input are equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dslaunch.runtime.comm import comm

__all__ = ["TensorSlices", "drop_tokens", "gather_tokens", "mpu_slices"]


@dataclass(frozen=True)
class TensorSlices:
    """The tensor group beside a MoE layer (``size`` 1: none)."""

    group: Any = None
    size: int = 1
    rank: int = 0
    experts_sliced: bool = False


def _share(x: Tensor, dim: int, slices: TensorSlices) -> Tensor:
    if x.shape[dim] % slices.size:
        from dslaunch.errors import UsageError

        raise UsageError(f"MoE with tensor parallelism: dimension {dim} of size {x.shape[dim]} does not split "
                         f"over the {slices.size} tensor slices")
    width = x.shape[dim] // slices.size
    return x.narrow(dim, slices.rank * width, width)


def _gather(x: Tensor, dim: int, slices: TensorSlices) -> Tensor:
    x = x.contiguous()
    stacked = x.new_empty((slices.size * x.shape[0], *x.shape[1:]))  # gloo wants dim 0 to grow
    comm.all_gather_into_tensor(stacked, x, group=slices.group)
    return torch.cat(stacked.chunk(slices.size, dim=0), dim=dim)


class _Drop(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, slices: TensorSlices) -> Tensor:
        ctx.dim, ctx.slices = dim, slices
        return _share(x, dim, slices).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.slices), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, slices: TensorSlices) -> Tensor:
        ctx.dim, ctx.slices = dim, slices
        return _gather(x, dim, slices)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _share(grad, ctx.dim, ctx.slices).contiguous(), None, None


def mpu_slices() -> TensorSlices:
    """The tensor slices of ``deepspeed.utils.groups.mpu`` (none without an mpu)."""
    from dslaunch.runtime.parallel import deepspeed_groups as groups
    from dslaunch.runtime.parallel.mpu import tensor_axis

    if groups.mpu is None or tensor_axis(groups.mpu, "world_size") == 1:
        return TensorSlices()
    return TensorSlices(tensor_axis(groups.mpu, "group"), tensor_axis(groups.mpu, "world_size"),
                        tensor_axis(groups.mpu, "rank"))


def drop_tokens(input_: Tensor, dim: int = 0, slices: TensorSlices | None = None) -> Tensor:
    """This slice's share of ``input_`` along ``dim`` (unchanged without tensor slices);
    ``slices`` None: the mpu's (DeepSpeed's ``deepspeed.moe.mappings.drop_tokens``).

    Raises:
        UsageError: ``dim`` does not split evenly over the slices.
    """
    slices = mpu_slices() if slices is None else slices
    return input_ if slices.size == 1 else _Drop.apply(input_, dim, slices)


def gather_tokens(input_: Tensor, dim: int = 0, slices: TensorSlices | None = None) -> Tensor:
    """Every slice's share of ``input_`` concatenated along ``dim``; ``slices`` None: the mpu's.
    collective: the tensor group."""
    slices = mpu_slices() if slices is None else slices
    return input_ if slices.size == 1 else _Gather.apply(input_, dim, slices)
