"""The gradient data DeepSpeed's optimizer wrappers expose, read from the ZeRO strategy
(``optimizer_view.py`` puts them under DeepSpeed's names).

DeepSpeed's wrappers keep their gradients in attributes its tests and some integrations read:
``averaged_gradients`` (ZeRO 1-3: this rank's gradient partitions per param group),
``_get_norm_groups()`` (ZeRO 3: each group's gradient norm over the ranks),
``fp32_groups_gradients_flat`` (``BF16_Optimizer``: each group's flat fp32 gradient) and
``parallel_partitioned_bit16_groups`` (ZeRO 1/2: every rank's partition of each group's 16-bit
weights). dslaunch's strategy keeps the same data in another form: the gradient of this rank's
range as the *sum* over the ranks (the averaging factor, the loss unscale and the clip are one
multiply at the step: ``strategy.py``), the weights in one flat buffer per group (``flat.py``).

So the gradients here are **copies**, averaged as DeepSpeed's are (still multiplied by the fp16
loss scale, as DeepSpeed's), taken when the attribute is read: a write into one does not reach the
step (``deepspeed.utils.safe_set_local_grad``/``safe_set_full_grad`` do). They exist where
DeepSpeed's do: once a backward's gradients are reduced (stages 0/1: at the accumulation boundary;
stages 2/3: every micro step), until the step; a group whose gradients are not reduced yet
(``no_sync()``, before the boundary, ``coalesce_grad_reduction``) has no entry. The 16-bit
partitions are views (the live weights).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dslaunch.runtime.zero.fragment import locate

__all__ = ["averaged_gradients", "norm_groups", "flat_gradients", "rank_partitions", "INVALID_NORM"]

INVALID_NORM = -1.0
"""What DeepSpeed's per-group norms hold for an inf/NaN gradient."""


def averaged_gradients(zero: Any, every_param: bool) -> dict[int, list[torch.Tensor]]:
    """Per reduced group, this rank's piece of each parameter's averaged gradient (1-D fp32
    copies, in group order): every parameter's (``every_param``, stage 3: a piece may be empty, as
    ``param.ds_tensor``), else those with elements on this rank (stages 1/2's ``params_in_partition``)."""
    out = {}
    for gi, g in enumerate(zero.groups):
        if zero.unreduced_grad(gi) is not None:  # not reduced yet: DeepSpeed has none either
            continue
        shard, start = zero.grad_shard(gi), g.layout.start  # read once: stage 0/1's 16-bit copy is remade per call
        frags = [locate(p) for p in g.params]
        out[gi] = [shard[f.lo - start:f.hi - start].to(torch.float32, copy=True).mul_(zero.average_factor)
                   for f in frags if every_param or f.numel]
    return out


def norm_groups(zero: Any) -> list[torch.Tensor]:
    """Each group's gradient norm over every rank (the averaged gradient, loss scale included, as
    DeepSpeed's stage 3 ``_get_norm_groups``); ``INVALID_NORM`` where it is not finite. Each
    parameter's elements count once (the pieces the strategy's global norm counts: ``grad_norm.units``).

    collective: all ranks of the data-parallel group (and of the expert and model-parallel groups).
    """
    out = []
    for gi in range(len(zero.groups)):
        sq = zero.group_grad_sumsq(gi)
        norm = math.sqrt(sq.item()) * zero.average_factor if math.isfinite(sq.item()) else INVALID_NORM
        out.append(torch.tensor(norm, dtype=torch.float32, device=sq.device))
    return out


def flat_gradients(zero: Any) -> list[torch.Tensor]:
    """Each group's whole gradient, flat, in fp32 (copies): this rank's own sum while it is not
    reduced (before the boundary), the average once it is. Stages 0/1 only (the whole gradient is
    kept there: ``BF16_Optimizer``'s stages)."""
    out = []
    for gi, g in enumerate(zero.groups):
        local = zero.unreduced_grad(gi)
        if local is not None:
            out.append(local[:g.layout.numel].to(torch.float32, copy=True))
            continue
        zero.grad_shard(gi)  # after a step: the buffer is zeroed, as the step would see it
        whole = torch.cat([zero.gradient_of(p).reshape(-1) for p in g.params]).float()
        out.append(whole.mul_(zero.average_factor))
    return out


def rank_partitions(zero: Any) -> list[list[torch.Tensor]]:
    """Per group, every rank's partition of the model weights (views of the flat buffer, in the
    model dtype, each ``layout.padded / ranks`` elements: the last may run into the padding)."""
    out = []
    for gi, g in enumerate(zero.groups):
        ranks = zero.group_comm(gi)[0]
        out.append([g.flat[a:b] for a, b in (g.layout.rank_range(r, ranks) for r in range(ranks))])
    return out
