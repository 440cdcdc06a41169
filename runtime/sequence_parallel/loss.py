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
ZeRO stages 1, 2 and 3 all follow it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["sequence_parallel_loss", "IGNORE_INDEX"]

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
