"""The loss of a sequence split over ranks: each rank's shard loss, weighted by its share of the
tokens that count.

A rank's loss is the mean over its shard's non-ignored tokens; the sequence's loss is the mean
over all of them, i.e. ``sum(loss_r * n_r) / sum(n_r)``: shards with more counted tokens (a
prompt masked out of an SFT sample, the padding of a length the group does not divide) weigh
more, and a shard with none weighs nothing (its NaN mean is not read).

Every rank gets the whole sequence's loss and backpropagates it through a differentiable sum
(the gradient of an all-reduce is an all-reduce), so each of the N ranks holds N times its part
of the gradient; the engine averages gradients over data x sequence
(``parallel.mpu.gradient_reduce_group``), which makes them the whole sequence's. This is the
convention of DeepSpeed's ALST tutorial (a differentiable all-gather of the losses); dslaunch's
ZeRO stages 0 to 3 all follow it.

Every loss that gathers or sums over the sequence group keeps it: the backward of a gather is the
sum over the ranks of each rank's rows (``own_rows_summed``), of a sum an all-reduce, never "this
rank's slice" alone. DeepSpeed's ``FPDT_LogitsLoss``, its legacy ``vocab_sequence_parallel_cross_entropy``
and the sequence sum of its ``vocab_parallel_cross_entropy`` keep the slice, which is the whole
gradient only under its reduction (a sum over the sequence ranks); under an average it is 1/N of it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sequence_parallel_loss", "own_rows_summed", "IGNORE_INDEX"]

IGNORE_INDEX = -100
"""The label of a token that does not count (torch's and Hugging Face's default)."""


def sequence_parallel_loss(loss: torch.Tensor, counted: torch.Tensor | int, group: Any) -> torch.Tensor:
    """The whole sequence's mean loss from this rank's ``loss`` (the mean over its ``counted``
    tokens), differentiable.

    Args:
        loss: this rank's mean loss over its shard (NaN allowed when ``counted`` is 0).
        counted: how many of the shard's tokens ``loss`` averages (``(shift_labels != -100).sum()``).
        group: the sequence group (``groups._get_sequence_parallel_group()``).

    collective: every rank of ``group``.
    """
    import torch.distributed as dist
    from torch.distributed.nn.functional import all_reduce

    counted = torch.as_tensor(counted, dtype=loss.dtype, device=loss.device)
    weighted = torch.where(counted > 0, loss, torch.zeros_like(loss)) * counted
    total = counted.detach().clone()
    dist.all_reduce(total, group=group)
    return all_reduce(weighted, group=group) / total.clamp(min=1)


def own_rows_summed(grad: torch.Tensor, rows: int, group: Any) -> torch.Tensor:
    """The backward of an all-gather on dimension 0: this rank's ``rows`` rows of ``grad`` summed
    over ``group`` (every rank's loss may read every rank's rows).

    Args:
        grad: the gradient of the gathered tensor (``rows`` rows per rank, in rank order).
        rows: this rank's rows in the gather.
        group: the group gathered over (``None`` or one rank: ``grad`` itself).

    Returns:
        ``[rows, ...]``, the gradient of this rank's input.

    collective: every rank of ``group``.
    """
    import torch.distributed as dist

    if group is None or dist.get_world_size(group) == 1:
        return grad
    out = grad.new_empty((rows, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad.contiguous(), group=group)
    return out
