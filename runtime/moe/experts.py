"""The experts one rank holds: DeepSpeed's ``Experts``, ``num_local_experts`` copies of one module.

Each copy's parameters carry DeepSpeed's marks of an expert parameter, which the engine's gradient
reduction and ZeRO read: ``allreduce = False`` (not averaged over the whole data-parallel group)
and ``group_name`` (the expert group, ``ep_size_<N>``, whose expert-data ranks hold the same copy).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["Experts"]


class Experts(torch.nn.Module):
    """``num_local_experts`` deep copies of ``expert``; ``forward`` gives copy ``i`` the slice
    ``[:, i]`` of its input ``[ep_size, num_local_experts, capacity, hidden]``."""

    def __init__(self, expert: torch.nn.Module, num_local_experts: int = 1,
                 expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        self.routed: tuple[Tensor, int] | None = None
        """The last call's routes (``[k, S]``: each route's expert, -1 when dropped) and the slots
        it ran (``num_experts * capacity``), set by ``MOELayer``: for ``flops_share``."""
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    @property
    def flops_share(self) -> Callable[[], float] | None:
        """For the flops profiler: the share of this call's slots that holds a routed token (kept
        routes over slots, read after the step). A rank counts its own tokens' expert work: over
        the expert group the counts add up to the experts' real work."""
        if self.routed is None:
            return None
        experts, slots = self.routed
        return lambda: int((experts >= 0).sum()) / slots

    def forward(self, inputs: Tensor) -> Tensor:
        outputs = []
        for chunk, expert in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # (output, bias) experts: the output
        return torch.cat(outputs, dim=1)
