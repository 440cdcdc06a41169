"""AutoEP's dispatch with exact counts: each rank sends each expert the routes it has, no padding.

``MOELayer``'s dispatch (``layer.py``) gives every expert the busiest expert's row count, so a
skewed routing moves ``num_experts * busiest`` rows per rank. Here, as DeepSpeed's AutoEP does,
the rows travel in variable sizes:

1. this rank's routes, sorted by expert (stable: route-major within an expert);
2. one small all-to-all of the per-expert counts over the expert group, so each rank knows how
   many rows each peer sends to each of its local experts;
3. ``all_to_all_single`` with those split sizes; the rows, received by source rank, are put
   expert-major for the experts (``GroupedExperts.rows``), and the way back is the reverse.

The same arithmetic as the padded path (no token is dropped in either); the bytes moved are the
routes, not the slots. The waits are marked for the hang monitor as ``MOELayer``'s are, and the
comms logger counts both all-to-alls. collective: the expert group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dslaunch.runtime.comm import comm
from dslaunch.runtime.heartbeat import wait_all

__all__ = ["exchange_counts", "routed_rows", "dispatch_exact"]


class _AllToAllV(torch.autograd.Function):
    """Rows of dim 0 exchanged over ``group`` in ``send`` / ``recv`` split sizes; the gradient
    takes the way back with the sizes swapped."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor, send: list[int], recv: list[int],  # noqa: A002
                names: tuple[str, str]) -> Tensor:
        ctx.group, ctx.send, ctx.recv, ctx.names = group, send, recv, names
        input = input.contiguous()
        output = input.new_empty((sum(recv), *input.shape[1:]))
        wait_all((comm.all_to_all_single(output, input, output_split_sizes=recv, input_split_sizes=send,
                                         group=group, async_op=True),), names[0])
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, None, None, None]:
        return None, _AllToAllV.apply(ctx.group, grad, ctx.recv, ctx.send, ctx.names[::-1]), None, None, None


def exchange_counts(counts: Tensor, group: Any, ep_size: int, name: str) -> Tensor:
    """``[ep_size, num_local]``: row ``r`` holds how many routes rank ``r`` of the group sends to
    each of this rank's local experts (``counts``: this rank's routes per global expert).
    collective: the expert group."""
    send = counts.to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    wait_all((comm.all_to_all_single(recv, send, group=group, async_op=True),), name)
    return recv.reshape(ep_size, -1)


def routed_rows(layer: Any, rows: Tensor, experts: Tensor) -> Tensor:
    """Each row of ``rows [R, H]`` through the expert ``experts [R]`` names, over ``layer``'s
    expert group (an ``AutoEPMoE``); the outputs in the rows' order. collective: the expert group."""
    order = torch.argsort(experts, stable=True)  # rows grouped by expert, each group in the given order
    counts = torch.bincount(experts, minlength=layer.num_experts)
    local = layer.num_local_experts
    dispatch, combine = (None, None) if layer.ep_size == 1 else (layer._wait_names("dispatch"),
                                                                 layer._wait_names("combine"))
    alone = layer.ep_size == 1
    # [source, local expert]
    received = counts.reshape(1, -1) if alone else exchange_counts(counts, layer.ep_group, layer.ep_size, dispatch[0])
    send = counts.reshape(layer.ep_size, local).sum(dim=1).tolist()
    recv = received.sum(dim=1).tolist()
    sent = rows.index_select(0, order)
    arrived = sent if alone else _AllToAllV.apply(layer.ep_group, sent, send, recv, dispatch)
    # arrived rows are (source, local expert)-major; the experts take them (local expert, source)-major
    segment = torch.repeat_interleave(torch.arange(received.numel(), device=rows.device), received.reshape(-1))
    by_expert = torch.argsort((segment % local) * layer.ep_size + segment // local, stable=True)
    out = layer.experts(arrived.index_select(0, by_expert), received.sum(dim=0).tolist())  # a call: ZeRO-3's hooks
    back = torch.empty_like(out).index_copy(0, by_expert, out)
    returned = back if alone else _AllToAllV.apply(layer.ep_group, back, recv, send, combine)
    return torch.empty_like(returned).index_copy(0, order, returned)


def dispatch_exact(layer: Any, tokens: Tensor, experts: Tensor, gates: Tensor) -> Tensor:
    """The routed experts' weighted output for ``tokens [S, H]`` whose routes go to ``experts
    [k, S]`` with weights ``gates [k, S]``, over ``layer``'s expert group (an ``AutoEPMoE``).
    collective: the expert group."""
    k, num_tokens = experts.shape
    routed = routed_rows(layer, tokens.repeat(k, 1), experts.reshape(-1)).reshape(k, num_tokens, -1)
    return (routed * gates.unsqueeze(-1).to(routed.dtype)).sum(dim=0)
