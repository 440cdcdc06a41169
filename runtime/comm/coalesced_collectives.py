"""``reduce_scatter_coalesced``: average several tensors over a group, keep this rank's part of each.

Each tensor is split as ZeRO splits a flat group (``partition_range``: ``ceil(numel / world)``
elements per rank, the last ranks may get fewer or none). All tensors travel in one all-reduce
of their concatenation (on gloo faster than a reduce-scatter of the same size).
``all_to_all_quant_reduce`` (DeepSpeed's quantized variant) needs a quantizer op dslaunch does
not have; it is importable and says so when called.

collective: call on every rank of ``group``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from dslaunch.runtime.zero.partition import partition_range
from dslaunch.utils.refused import Refusal, refused_function

__all__ = ["reduce_scatter_coalesced", "all_to_all_quant_reduce"]


def reduce_scatter_coalesced(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """This rank's slice of the mean of each tensor over ``group`` (1-D, in the tensors' dtype)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat.div_(world)
    out, offset = [], 0
    for t in tensors:
        start, end = partition_range(t.numel(), world, rank)
        out.append(flat[offset + start:offset + end].clone())
        offset += t.numel()
    return out


all_to_all_quant_reduce = refused_function(
    __name__, "all_to_all_quant_reduce",
    Refusal("DeepSpeed's quantized all-to-all reduce (its quantizer op)",
            "ZeRO++ quantized gradients are the config's zero_optimization.zero_quantized_gradients"))
