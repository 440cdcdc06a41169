"""A token-by-token mixture of experts, written from the rules (no masks, no einsum), to check the layer.

Top-1: each token goes to its most probable expert, weighted by that probability; with token
dropping an expert takes the first ``max(ceil(S / E * cf), min_capacity)`` tokens in order.
Top-2: first choices take slots before second choices (an expert's second-choice tokens queue
behind all of its first-choice tokens), capacity ``max(ceil(S / E * 2 cf), min_capacity)``, and
the kept gates are renormalised to sum to 1. Residual MoE mixes in ``mlp`` by a softmax coefficient.
"""

from __future__ import annotations

import math

import torch


def reference_moe(tokens: torch.Tensor, wg: torch.Tensor, experts: list[torch.nn.Module], k: int,
                  capacity_factor: float, min_capacity: int, drop_tokens: bool,
                  mlp: torch.nn.Module | None = None, coefficient: torch.nn.Module | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [S, M], l_aux)`` of tokens ``[S, M]`` through router weights ``wg`` ``[E, M]``."""
    num_tokens, num_experts = tokens.shape[0], wg.shape[0]
    probs = torch.softmax(tokens @ wg.t(), dim=1)
    first = [int(probs[s].argmax()) for s in range(num_tokens)]
    choices = [[e] for e in first]
    if k == 2:
        for s in range(num_tokens):
            rest = probs[s].detach().clone()
            rest[first[s]] = -1.0
            choices[s].append(int(rest.argmax()))
    capacity = max(math.ceil(num_tokens / num_experts * capacity_factor * k), min_capacity) if drop_tokens \
        else num_tokens * k
    taken = [0] * num_experts
    kept = [[False] * k for _ in range(num_tokens)]
    for rank in range(k):  # all first choices queue before any second choice
        for s in range(num_tokens):
            e = choices[s][rank]
            kept[s][rank] = taken[e] < capacity
            taken[e] += 1
    rows = []
    for s in range(num_tokens):
        gates = [probs[s, e] if kept[s][i] else probs[s, e] * 0 for i, e in enumerate(choices[s])]
        if k == 2:
            denom = torch.clamp(gates[0] + gates[1], min=torch.finfo(probs.dtype).eps)
            gates = [g / denom for g in gates]
        row = tokens.new_zeros(tokens.shape[1])
        for g, e in zip(gates, choices[s], strict=True):
            row = row + g * experts[e](tokens[s:s + 1])[0]
        rows.append(row)
    output = torch.stack(rows)
    if mlp is not None and coefficient is not None:
        coef = torch.softmax(coefficient(tokens), dim=-1)
        output = output * coef[:, 0:1] + mlp(tokens) * coef[:, 1:]
    share = torch.zeros(num_experts)
    for e in first:
        share[e] += 1.0 / num_tokens
    balance = probs.mean(dim=0) * share
    l_aux = balance.sum() * num_experts if k == 1 else balance.mean() * num_experts * num_experts
    return output, l_aux
