"""The experts one rank holds after AutoEP: ``num_local_experts`` gated MLPs stored as 3D weights,
as Hugging Face's fused MoE layers store them (``gate_up_proj [E, 2F, H]``, ``down_proj [E, H, F]``,
or a separate up projection ``[E, F, H]``).

``GroupedExperts`` is the ``experts`` of a ``MOELayer``: its input is the all-to-all's
``[ep_size, num_local_experts, capacity, hidden]`` and its output has the same layout. Expert ``j``
computes ``down(act(x @ gate_j^T) * (x @ up_j^T))``, the Hugging Face expert's arithmetic. With
``use_grouped_mm`` each projection is one ``torch._grouped_mm`` over all local experts (equal groups
of ``ep_size * capacity`` rows); where the operator is missing, or a row of a weight is not a
multiple of 16 bytes (its alignment rule), a loop over the experts does the same work and a log
line says so (and the loop takes over if the operator fails on the device).

Each weight carries DeepSpeed's marks of an expert parameter (``allreduce = False``, ``group_name``
``ep_size_<N>``), so ZeRO reduces it over its expert-data group only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["GroupedExperts", "grouped_mm_fits"]

log = logging.getLogger(__name__)


def grouped_mm_fits(weights: list[Tensor]) -> bool:
    """Whether ``torch._grouped_mm`` can take these weights here: the operator exists and every
    weight's rows (and the activations' rows, as wide) are multiples of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    return all(w.shape[-1] * w.element_size() % 16 == 0 and w.shape[-2] * w.element_size() % 16 == 0 for w in weights)


def _project(x: Tensor, weight: Tensor, grouped: bool, offsets: Tensor | None = None) -> Tensor:
    """``x [L, N, in] @ weight[L, out, in]^T`` per expert; with ``offsets``, ``x [N, in]`` whose
    rows ``[offsets[j-1], offsets[j])`` are expert ``j``'s."""
    if grouped:
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    return torch.stack([F.linear(x[j], weight[j]) for j in range(weight.shape[0])])


class GroupedExperts(torch.nn.Module):
    """Local experts whose weights are slices ``[first, first + num_local)`` of a fused MoE layer's.

    Args:
        weights: name -> the local slice of each 3D weight, in the model's names: the gate (or
            fused gate+up) projection ``w1``, the down projection ``w2``, the up projection ``w3``
            when it is separate (None: fused in ``w1``).
        names: ``(w1, w2, w3)`` names, ``w3`` None when fused.
        act_fn: the experts' activation (the model's ``act_fn``).
        use_grouped_mm: ``expert_parallel.use_grouped_mm``.
        expert_group_name: ``ep_size_<N>``, the group ZeRO reduces these over.
    """

    def __init__(self, weights: dict[str, Tensor], names: tuple[str, str, str | None],
                 act_fn: Callable[[Tensor], Tensor], use_grouped_mm: bool, expert_group_name: str) -> None:
        super().__init__()
        self.names = names
        self.act_fn = act_fn
        for name, value in weights.items():
            param = torch.nn.Parameter(value.detach().clone(), requires_grad=value.requires_grad)
            param.allreduce = False
            param.group_name = expert_group_name
            self.register_parameter(name, param)
        self.num_local_experts = weights[names[0]].shape[0]
        self.use_grouped_mm = use_grouped_mm
        self._said = False

    @property
    def grouped(self) -> bool:
        """Whether ``forward`` runs ``torch._grouped_mm`` (asked anew: the engine may cast the weights
        to a dtype whose rows no longer fit)."""
        fits = self.use_grouped_mm and grouped_mm_fits(list(self.parameters()))
        if self.use_grouped_mm and not fits and not self._said:
            self._said = True
            log.info("AutoEP: torch._grouped_mm is %s; the %d local experts run in a loop",
                     "missing" if not hasattr(torch, "_grouped_mm") else "not usable with rows of these sizes "
                     "(not multiples of 16 bytes)", self.num_local_experts)
        return fits

    def forward(self, inputs: Tensor, counts: list[int] | None = None) -> Tensor:
        """``inputs [ep_size, num_local, capacity, hidden]`` (equal groups), or, with ``counts``,
        rows ``[N, hidden]`` held expert-major (``rows``). Called as a module, so ZeRO-3 gathers
        the weights first."""
        if counts is not None:
            return self.rows(inputs, counts)
        ep_size, local, capacity, width = inputs.shape
        x = inputs.transpose(0, 1).reshape(local, ep_size * capacity, width)
        try:
            out = self._mlp(x, self.grouped)
        except (RuntimeError, NotImplementedError) as err:  # an operator this device's build lacks
            if not self.grouped:
                raise
            log.info("AutoEP: torch._grouped_mm failed on %s (%s); the local experts run in a loop from now on",
                     x.device, str(err).splitlines()[0][:200])
            self.use_grouped_mm = self._said = False
            out = self._mlp(x, False)
        return out.reshape(local, ep_size, capacity, width).transpose(0, 1)

    def rows(self, x: Tensor, counts: list[int]) -> Tensor:
        """The experts on rows ``x [N, hidden]`` held expert-major, ``counts[j]`` rows for local
        expert ``j`` (AutoEP's exact dispatch: groups of any size, none padded)."""
        if self.grouped and x.shape[0] > 0:
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            try:
                return self._mlp(x, True, offsets)
            except (RuntimeError, NotImplementedError) as err:  # as in forward: the loop takes over
                log.info("AutoEP: torch._grouped_mm failed on %s (%s); the local experts run in a loop from now on",
                         x.device, str(err).splitlines()[0][:200])
                self.use_grouped_mm = self._said = False
        parts = [self._mlp(chunk.unsqueeze(0), False, None, j).squeeze(0)
                 for j, chunk in enumerate(x.split(counts))]
        return torch.cat(parts) if parts else x

    def _mlp(self, x: Tensor, grouped: bool, offsets: Tensor | None = None, expert: int | None = None) -> Tensor:
        """The experts' MLP on ``x``: ``[L, N, in]`` one group per expert, or ``[N, in]`` in
        ``offsets`` groups (grouped), or ``[1, N, in]`` of local expert ``expert`` alone."""
        w1, w2, w3 = (getattr(self, n) if n is not None else None for n in self.names)
        if expert is not None:
            w1, w2, w3 = (w[expert:expert + 1] if w is not None else None for w in (w1, w2, w3))
        if w3 is None:
            gate, up = _project(x, w1, grouped, offsets).chunk(2, dim=-1)
        else:
            gate, up = _project(x, w1, grouped, offsets), _project(x, w3, grouped, offsets)
        return _project(self.act_fn(gate) * up, w2, grouped, offsets)
