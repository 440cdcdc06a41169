"""The whole model's state dict from its tensor-parallel slices (DeepSpeed's
``engine._consolidated_16bit_state_dict`` under AutoTP).

Two kinds of slices are put back together, each rank's read from the others:

- the planner's (``initialize`` with ``tensor_parallel.autotp_size``): ``model.ds_tensor_layout``
  says, per tensor, the dimension and this rank's ``[start, stop)`` segments of it (and whether the
  model's own module stores the weight transposed, GPT-2's ``Conv1D``);
- the hand-built layers' (``deepspeed_layers.py``): each gathers copies of its parameters
  (``whole``; the live ones stay as they are: ZeRO may hold them as views of its buffers).

The result has the model's own keys and shapes, as if it had never been split.

collective: every rank of the tensor group.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dslaunch.runtime.tensor_parallel.collectives import gather_last_dim
from dslaunch.runtime.tensor_parallel.deepspeed_layers import TensorParallelLayer

__all__ = ["whole_state_dict"]


def _assemble(local: torch.Tensor, entry: list, group: Any) -> torch.Tensor:
    """The whole tensor of ``local`` (this rank's segments along ``entry``'s dimension). collective."""
    dim, segments, whole, transposed = entry
    everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, [list(s) for s in segments], group=group)
    widths = [sum(b - a for a, b in segs) for segs in everyone]
    parts = gather_last_dim(local.detach().movedim(dim, -1), widths, group).split(widths, dim=-1)
    shape = list(local.shape)
    shape[dim] = whole
    out = local.new_zeros(shape).movedim(dim, -1)
    for segs, part in zip(everyone, parts, strict=True):
        offset = 0
        for a, b in segs:
            out[..., a:b] = part[..., offset:offset + b - a]
            offset += b - a
    out = out.movedim(-1, dim)
    return out.t().contiguous() if transposed else out.contiguous()


def whole_state_dict(module: nn.Module, group: Any, sliced: dict[str, torch.Tensor] | None = None
                     ) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every tensor-parallel slice made whole (copies: the module
    keeps its slices).

    Args:
        sliced: this rank's state dict to join instead of ``module.state_dict()`` (ZeRO-3's, each
            slice gathered whole over the data-parallel ranks first: ``zero.full_state``).

    collective: every rank of ``group``.
    """
    hand_built: dict[str, tuple[TensorParallelLayer, torch.Tensor]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        if isinstance(m, TensorParallelLayer):
            for attr, p in m.named_parameters(recurse=False):
                hand_built[f"{prefix}.{attr}" if prefix else attr] = (m, p)
    out = {}
    layout = getattr(module, "ds_tensor_layout", None) or {}
    for name, t in (module.state_dict() if sliced is None else sliced).items():
        if name in hand_built:
            layer, p = hand_built[name]
            out[name] = layer.whole(p, t)
        elif name in layout:
            out[name] = _assemble(t, layout[name], group)
        else:
            out[name] = t.detach().clone()
    return out
