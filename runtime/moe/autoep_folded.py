"""AutoEP folded with AutoTP: a converted block's routes split over the tensor slices of a replica
(DeepSpeed 0.19.x's AutoEP+AutoTP folding, ``deepspeed.moe.ep_tp_dispatch``).

The ``tp`` tensor slices of a replica hold the same tokens and run the same router, so each knows
every route. Each expert's routes, in route-major order, go to the slices in turn (route ``o`` of
an expert to slice ``o % tp``, DeepSpeed's rule): every route is computed once over the tensor
group, and every slice sends ``1 / tp`` of each expert's rows over the expert group
(``autoep_dispatch.routed_rows``, exact counts). The slices then gather each other's expert rows
(sizes known without asking: the split is computed from the shared routes) and every slice
combines all of them with the router's weights, as the unfolded block does.

Gradients, with no correction afterwards: the gather's backward keeps this slice's rows (the
gradient reaching them is the same on every slice: the combine is replicated), so each expert row
gets its gradient once; the tokens' backward through the expert path sums the slices' shares over
the tensor group (each saw only its routes), so the block's input gradient is whole on every
slice, and the router's, computed by every slice from the whole combine, is the unfolded one.
The dense parameters' gradients are then equal on the slices and reduce over the data group; the
experts' reduce over their expert-data group (``runtime/zero``), dividing by the replicas.
collective: the tensor group and the expert group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dslaunch.runtime.comm import comm
from dslaunch.runtime.moe.autoep_dispatch import routed_rows
from dslaunch.runtime.moe.folding_metadata import ROUTE_FULL_PARTITION_DISPATCH
from dslaunch.runtime.moe.tensor_slices import TensorSlices

__all__ = ["route_lanes", "dispatch_folded", "folding_metadata"]


def route_lanes(experts: Tensor, num_experts: int, tp_size: int) -> Tensor:
    """The tensor slice that runs each route of ``experts`` (flat, route-major): an expert's
    ``o``-th route goes to slice ``o % tp_size`` (every expert split once over the slices)."""
    onehot = torch.nn.functional.one_hot(experts, num_experts)
    ordinal = ((onehot.cumsum(dim=0) - 1) * onehot).sum(dim=1)
    return ordinal % tp_size


class _SumOverSlices(torch.autograd.Function):
    """Identity forward; the backward sums the slices' gradients (each saw its own routes)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, slices: TensorSlices) -> Tensor:
        ctx.slices = slices
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.slices.group)
        return grad, None


class _GatherRows(torch.autograd.Function):
    """Every slice's rows placed at their routes (``[routes, H]``); the backward keeps this slice's
    rows (their gradient is the same on every slice)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, lanes: Tensor, slices: TensorSlices) -> Tensor:
        ctx.mine = torch.nonzero(lanes == slices.rank).flatten()
        counts = torch.bincount(lanes, minlength=slices.size).tolist()
        width = max(counts)
        padded = rows.new_zeros((width, *rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        stacked = rows.new_empty((slices.size * width, *rows.shape[1:]))
        comm.all_gather_into_tensor(stacked, padded.contiguous(), group=slices.group)
        taken = torch.cat([stacked[lane * width:lane * width + n] for lane, n in enumerate(counts)])
        where = torch.cat([torch.nonzero(lanes == lane).flatten() for lane in range(slices.size)])
        return rows.new_empty((lanes.numel(), *rows.shape[1:])).index_copy(0, where, taken)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad.index_select(0, ctx.mine), None, None


def dispatch_folded(layer: Any, tokens: Tensor, experts: Tensor, gates: Tensor, slices: TensorSlices) -> Tensor:
    """The routed experts' weighted output for ``tokens [S, H]`` (the same on every slice), routes
    ``experts [k, S]`` weighted ``gates [k, S]``: this slice's share of the routes through
    ``layer``'s expert group, the others' gathered back. collective: the tensor and expert groups."""
    k, num_tokens = experts.shape
    flat = experts.reshape(-1)
    lanes = route_lanes(flat, layer.num_experts, slices.size)
    mine = torch.nonzero(lanes == slices.rank).flatten()
    shared = _SumOverSlices.apply(tokens, slices)
    out = routed_rows(layer, shared.index_select(0, mine % num_tokens), flat.index_select(0, mine))
    routed = _GatherRows.apply(out, lanes, slices).reshape(k, num_tokens, -1)
    return (routed * gates.unsqueeze(-1).to(routed.dtype)).sum(dim=0)


def folding_metadata(module: torch.nn.Module) -> dict | None:
    """What a checkpoint of ``module`` records of its folding (DeepSpeed's ``folding`` entry: its
    version and ``tp_size`` / ``ep_size`` / ``etp_size``, with the layout's other sizes and the
    dispatch), or None for a model with no folded block. A tag loads only where this is the same."""
    from dslaunch.runtime.moe.autoep import AutoEPMoE

    folded = [m for m in module.modules() if isinstance(m, AutoEPMoE) and m.folding_group_handles is not None]
    if not folded:
        return None
    spec = folded[0].folding_group_handles.spec
    return {"version": 1, "tp_size": spec.tp_size, "ep_size": spec.ep_size, "etp_size": spec.etp_size,
            "dp_size": spec.dp_size, "edp_size": spec.edp_size, "pp_size": spec.pp_size,
            "world_size": spec.world_size,
            "dispatch_strategy": "padded" if folded[0].padded else ROUTE_FULL_PARTITION_DISPATCH}
