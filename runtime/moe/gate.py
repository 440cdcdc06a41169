"""The router of a mixture-of-experts layer: DeepSpeed's ``TopKGate`` and its top-1, top-2 and
top-k gating functions (GShard's gating, as ``deepspeed.moe.sharded_moe`` has it).

A gating function takes the router's logits ``[S, E]`` for this rank's ``S`` tokens and decides
``Routes``: for each of a token's ``k`` routes the expert (-1: dropped), the slot in that expert's
``C`` slots (``C``, the capacity, is the same on every rank of the expert group) and the gate
weight, with the load-balancing loss and how many tokens chose each expert (before any was
dropped). ``MOELayer`` moves tokens by those slot indices; the public functions return DeepSpeed's
dense form ``(l_aux, combine_weights [S, E, C], dispatch_mask [S, E, C], exp_counts)``, or with
``sparse_routes`` DeepSpeed's ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``.

The capacity rule is DeepSpeed's: with ``drop_tokens`` an expert takes at most
``max(ceil(S / E * capacity_factor * k), min_capacity)`` tokens and the rest are dropped (their
output is 0: a residual connection around the layer carries them); without it the capacity is the
busiest expert's count, the maximum over the expert group (a collective on ``ep_group``).

Differences from DeepSpeed, on purpose: which tokens top-1 keeps without ``use_rts`` is the first
ones by position (DeepSpeed leaves the choice to ``torch.topk`` among equal scores); the random draws
(RSample and second-expert Gumbel noise, jitter, random token selection) come from torch's default
generator on each call, with no cache of distributions per device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from dslaunch.runtime.comm import comm

__all__ = ["TopKGate", "Routes", "top1gating", "top2gating", "topkgating", "multiplicative_jitter", "gumbel_rsample",
           "route_slots", "sparse_encode", "sparse_decode"]

GateOutput = tuple[Tensor, Tensor, Tensor, Tensor]
NoisyGatePolicy = Literal["Jitter", "RSample", "None"] | None


def multiplicative_jitter(x: Tensor, device: torch.device | None = None, epsilon: float = 1e-2) -> Tensor:
    """``x`` times uniform noise in ``[1 - epsilon, 1 + epsilon]`` (Switch Transformer's jitter)."""
    if epsilon == 0:
        return x
    noise = torch.empty_like(x, device=device or x.device).uniform_(1.0 - epsilon, 1.0 + epsilon)
    return x * noise


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device | None = None) -> Tensor:
    """Standard Gumbel noise of ``shape``: ``-log(-log(U))``, ``U`` uniform in (0, 1)."""
    uniform = torch.rand(shape, device=device).clamp_(min=torch.finfo(torch.float32).tiny, max=1.0 - 1e-7)
    return -torch.log(-torch.log(uniform))


def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def _busiest(exp_counts: Tensor, ep_group: object | None) -> int:
    """The largest expert count over the expert group: every rank of it must use one capacity,
    since the all-to-all exchanges equal blocks. Collective on ``ep_group`` when it has >1 rank."""
    busiest = exp_counts.max().to(torch.int64).reshape(1)
    # through deepspeed.comm, looked up at call time: the comms logger counts it, as DeepSpeed's does
    if ep_group is not None and comm.get_world_size(group=ep_group) > 1:
        comm.all_reduce(busiest, op=comm.ReduceOp.MAX, group=ep_group)
    return int(busiest.item())


def route_slots(experts: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The flat slot ``expert * capacity + location`` of every route (``experts`` and ``locations``
    ``[k, S]``); a dropped route (expert -1) gets the scratch slot ``num_experts * capacity``, one
    past the end, so moving tokens needs no branch (DeepSpeed's ``_route_slots``)."""
    flat = experts.long() * capacity + locations.long()
    return torch.where(experts >= 0, flat, torch.full_like(flat, num_experts * capacity))


def sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The ``[E, C, M]`` expert buffer with each routed token ``tokens`` ``[S, M]`` in its slot
    (``slots`` ``[k, S]`` from ``route_slots``); empty slots are 0. Each slot holds at most one
    token, so one ``index_add`` places them all; dropped routes pile up in the scratch row, cut off."""
    width = tokens.shape[-1]
    placed = tokens.new_zeros(num_experts * capacity + 1, width).index_add(0, slots.reshape(-1),
                                                                            tokens.repeat(slots.shape[0], 1))
    return placed[:-1].reshape(num_experts, capacity, width)


def sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """Each token's expert outputs (``expert_output`` ``[E * C, M]``) gathered back by ``slots``
    ``[k, S]`` and summed weighted by ``gates`` ``[k, S]``; a dropped route adds 0. The weighting and
    the sum run in the gates' dtype (fp32: a bf16/fp16 sum over routes loses precision), the result
    is in ``expert_output``'s."""
    width = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, width)])
    picked = padded.index_select(0, slots.reshape(-1)).reshape(slots.shape[0], num_tokens, width)
    return (picked * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)


@dataclass(frozen=True)
class Routes:
    """Where this rank's tokens go: ``experts``, ``locations`` and ``gates`` are ``[k, S]`` (route
    ``r`` of token ``s``: expert, -1 when dropped; its slot among the expert's ``capacity``; its
    weight in the output, differentiable)."""

    l_aux: Tensor
    capacity: int
    num_experts: int
    experts: Tensor
    locations: Tensor
    gates: Tensor
    exp_counts: Tensor

    def slots(self) -> Tensor:
        """``[k, S]`` flat slot ``expert * capacity + location``; a dropped route gets the scratch
        slot ``num_experts * capacity`` (one past the end), so moving tokens needs no branch."""
        return route_slots(self.experts, self.locations, self.num_experts, self.capacity)

    def dense(self) -> GateOutput:
        """DeepSpeed's dense form: ``(l_aux, combine_weights, dispatch_mask, exp_counts)``."""
        k, num_tokens = self.experts.shape
        width = self.num_experts * self.capacity
        flat = self.gates.new_zeros(num_tokens, width + 1).scatter_add(1, self.slots().t(), self.gates.t())
        combine = flat[:, :width].reshape(num_tokens, self.num_experts, self.capacity)
        return self.l_aux, combine, combine.bool(), self.exp_counts

    def as_tuple(self) -> tuple[Tensor, int, int, Tensor, Tensor, Tensor, Tensor]:
        """DeepSpeed's ``sparse_routes`` form: ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``."""
        return (self.l_aux, self.capacity, self.num_experts, self.experts.to(torch.int32),
                self.locations.to(torch.int32), self.gates, self.exp_counts)


def _route(mask: Tensor, locations: Tensor, gates: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One route per token from a one-hot ``mask`` ``[S, E]`` (all zero: dropped): its expert
    (-1), location and gate (``gates`` ``[S, E]`` or ``[S, 1]``)."""
    experts = torch.where(mask.any(dim=1), mask.argmax(dim=1), torch.full_like(mask[:, 0], -1))
    return experts, (locations * mask).sum(dim=1), (gates * mask).sum(dim=1)


def _routes(l_aux: Tensor, capacity: int, exp_counts: Tensor, *routes: tuple[Tensor, Tensor, Tensor]) -> Routes:
    experts, locations, gates = (torch.stack(column) for column in zip(*routes, strict=True))
    # at least one slot: an all-dropped step still exchanges blocks of one shape on every rank
    return Routes(l_aux, max(capacity, 1), exp_counts.shape[0], experts.long(), locations.long(), gates,
                  exp_counts)


def _output(routes: Routes, sparse_routes: bool) -> GateOutput | tuple:
    return routes.as_tuple() if sparse_routes else routes.dense()


def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: NoisyGatePolicy = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group: object | None = None, sparse_routes: bool = False) -> GateOutput | tuple:
    return _output(_top1(logits, capacity_factor, min_capacity, used_token, noisy_gate_policy, drop_tokens,
                         use_rts, ep_group), sparse_routes)


def _top1(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None,
          noisy_gate_policy: NoisyGatePolicy, drop_tokens: bool, use_rts: bool, ep_group: object | None) -> Routes:
    """Top-1 gating: each token goes to its most likely expert (with RSample, the most likely after
    Gumbel noise); over capacity, kept tokens are chosen at random (``use_rts``) or by position.

    Raises:
        ValueError: fewer tokens than ``min_capacity``.
    """
    num_tokens, num_experts = logits.shape
    if num_tokens < min_capacity:
        raise ValueError(f"MoE top-1 gating: {num_tokens} tokens is fewer than min_capacity={min_capacity}; "
                         "set min_capacity to 0 or give the layer a larger batch")
    gates = F.softmax(logits, dim=1)
    scores = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else gates
    mask = F.one_hot(scores.argmax(dim=1), num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor, min_capacity)
    else:
        capacity = min(_busiest(exp_counts, ep_group), num_tokens)
    if use_rts:
        priority = mask * torch.rand(mask.shape, device=mask.device)
        keep = torch.zeros_like(mask).scatter_(0, priority.topk(min(capacity, num_tokens), dim=0).indices, 1)
        mask = mask * keep
        locations = torch.cumsum(mask, dim=0) - 1
    else:
        locations = torch.cumsum(mask, dim=0) - 1
        mask = mask * (locations < capacity)
    return _routes(l_aux, capacity, exp_counts, _route(mask, locations, gates))


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: object | None = None, top2_2nd_expert_sampling: bool = True,
               sparse_routes: bool = False) -> GateOutput | tuple:
    return _output(_top2(logits, capacity_factor, min_capacity, drop_tokens, ep_group, top2_2nd_expert_sampling),
                   sparse_routes)


def _top2(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool, ep_group: object | None,
          top2_2nd_expert_sampling: bool) -> Routes:
    """Top-2 gating: the most likely expert, then the next (sampled with Gumbel noise when
    ``top2_2nd_expert_sampling``); first choices take slots before second ones; the two kept gates
    are renormalised to sum to 1."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(gates.argmax(dim=1), num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    mask2 = F.one_hot(logits.masked_fill(mask1.bool(), float("-inf")).argmax(dim=1), num_classes=num_experts)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = _busiest(exp_counts, ep_group)
    gates1 = (gates * mask1).sum(dim=1)
    gates2 = (gates * mask2).sum(dim=1)
    denom = torch.clamp(gates1 + gates2, min=torch.finfo(gates.dtype).eps)
    return _routes(l_aux, capacity, exp_counts, _route(mask1, locations1, (gates1 / denom).unsqueeze(1)),
                   _route(mask2, locations2, (gates2 / denom).unsqueeze(1)))


DropPolicy = Literal["probs", "position"]
DROP_POLICIES = ("probs", "position")


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group: object | None = None, drop_policy: DropPolicy = "probs",
               sparse_routes: bool = False) -> GateOutput | tuple:
    return _output(_topk(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy), sparse_routes)


def _topk(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool,
          ep_group: object | None, drop_policy: DropPolicy = "probs") -> Routes:
    """Top-k gating for ``k`` > 2: the ``k`` most likely experts, gates renormalised over those
    kept; over capacity an expert keeps its highest-gate tokens (``drop_policy="probs"``) or its
    first ones by position (``"position"``).

    Raises:
        ValueError: a ``drop_policy`` other than the two.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"topkgating: drop_policy={drop_policy!r}; use one of {', '.join(DROP_POLICIES)}")
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.long).scatter_(1, top_idx, 1)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate.detach())
            chosen = ranked.topk(min(capacity, num_tokens), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, chosen, 1)
        else:
            mask = mask * (torch.cumsum(mask, dim=0) - 1 < capacity)
    else:
        capacity = _busiest(exp_counts, ep_group)
    locations = torch.cumsum(mask, dim=0) - 1
    kept = gates * mask
    kept = kept / torch.clamp(kept.sum(dim=1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    taken = mask.gather(1, top_idx) > 0
    experts = torch.where(taken, top_idx, torch.full_like(top_idx, -1))
    places, weights = (locations * mask).gather(1, top_idx), kept.gather(1, top_idx)
    return _routes(l_aux, capacity, exp_counts, *((experts[:, j], places[:, j], weights[:, j]) for j in range(k)))


class TopKGate(torch.nn.Module):
    """The router: a bias-free linear map to one logit per expert, then top-``k`` gating.

    Args:
        model_dim: the hidden size of the tokens.
        num_experts: experts over the whole expert group.
        k: experts per token (1, 2, or more).
        capacity_factor, eval_capacity_factor: slots per expert relative to an even split, in
            training and in eval mode.
        min_capacity: the fewest slots an expert gets when tokens are dropped.
        noisy_gate_policy: ``"RSample"`` (Gumbel noise on top-1's choice), ``"Jitter"``
            (multiplicative noise on the input) or None; applied in training mode only.
        drop_tokens: drop tokens over capacity (False: capacity of the busiest expert, a collective).
        use_rts: top-1 keeps random tokens over capacity, not the first ones.
        ep_group: the expert-parallel group (set later by ``MoE.set_deepspeed_parallelism``).
        top2_2nd_expert_sampling: sample top-2's second expert with Gumbel noise.
    """

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: NoisyGatePolicy = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group: object | None = None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0

    def _set_ep_group(self, ep_group: object) -> None:
        if self.ep_group is not None and ep_group is not self.ep_group:
            raise RuntimeError("TopKGate: its expert-parallel group is already set to another group")
        self.ep_group = ep_group

    def random_draws(self) -> list[str]:
        """The options under which training routes by random draws (empty: none)."""
        return [what for what, yes in (
            (f"noisy_gate_policy={self.noisy_gate_policy}", self.noisy_gate_policy in ("RSample", "Jitter")),
            ("top2_2nd_expert_sampling", self.k == 2 and self.top2_2nd_expert_sampling),
            ("use_rts with drop_tokens", self.k == 1 and self.use_rts and self.drop_tokens)) if yes]

    def forward(self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False,  # noqa: A002
                use_tutel: bool = False) -> GateOutput | tuple:
        """DeepSpeed's gate output for tokens ``input`` ``[S, M]``: the dense
        ``(l_aux, combine_weights, dispatch_mask, exp_counts)``, or with ``sparse_routes``
        ``(l_aux, capacity, E, indices, locations, gates, exp_counts)``."""
        return _output(self.route(input, used_token), sparse_routes)

    def route(self, input: Tensor, used_token: Tensor | None = None) -> Routes:  # noqa: A002 (DeepSpeed's name)
        """The ``Routes`` of tokens ``input`` ``[S, M]`` (routing in fp32 whatever the input's dtype)."""
        tokens = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            tokens = multiplicative_jitter(tokens)
        logits = F.linear(tokens, self.wg.weight.float())
        capacity_factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return _top1(logits, capacity_factor, self.min_capacity, used_token,
                         self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                         self.ep_group)
        if self.k == 2:
            return _top2(logits, capacity_factor, self.min_capacity, self.drop_tokens, self.ep_group,
                         self.top2_2nd_expert_sampling)
        return _topk(logits, self.k, capacity_factor, self.min_capacity, self.drop_tokens, self.ep_group)
