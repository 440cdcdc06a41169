"""``MoE`` on one process against a token-by-token reference: top-1 and top-2 routing, the capacity
rule and token dropping, residual MoE, ``l_aux``, gradients; the noisy policies and random token
selection; one-line refusals of bad arguments."""

from __future__ import annotations

import math

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.moe.layer import MoE
from dslaunch.moe.sharded_moe import top1gating
from tests.runtime.moe.reference import reference_moe

pytestmark = pytest.mark.timeout(60)

HIDDEN, EXPERTS, TOKENS = 6, 4, 24


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, 2 * HIDDEN), torch.nn.Tanh(), torch.nn.Linear(2 * HIDDEN, HIDDEN))


def distinct_experts(layer: MoE, seed: int) -> None:
    """Give every expert its own weights (``Experts`` starts them as copies of one module)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.deepspeed_moe.experts.parameters():
            p.copy_(torch.randn_like(p) * 0.5)


def _layer(k: int, drop_tokens: bool, use_residual: bool, **kwargs: object) -> MoE:
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=k, min_capacity=2, drop_tokens=drop_tokens,
                use_residual=use_residual, use_rts=False, top2_2nd_expert_sampling=False, **kwargs)
    distinct_experts(layer, 1)
    return layer


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
@pytest.mark.parametrize("use_residual", [False, True])
def test_layer_equals_the_token_by_token_reference(k: int, drop_tokens: bool, use_residual: bool) -> None:
    layer = _layer(k, drop_tokens, use_residual)
    torch.manual_seed(2)
    tokens = torch.randn(TOKENS, HIDDEN) * 2
    out, l_aux, counts = layer(tokens.reshape(4, TOKENS // 4, HIDDEN))
    experts = list(layer.deepspeed_moe.experts.deepspeed_experts)
    residual = (layer.mlp, layer.coefficient) if use_residual else (None, None)
    ref_out, ref_l_aux = reference_moe(tokens, layer.deepspeed_moe.gate.wg.weight, experts, k, 1.0, 2,
                                       drop_tokens, *residual)
    torch.testing.assert_close(out.reshape(TOKENS, HIDDEN), ref_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(l_aux, ref_l_aux, atol=1e-6, rtol=0)
    assert int(counts.sum()) == TOKENS * k
    capacity = max(math.ceil(TOKENS / EXPERTS * k), 2)
    if drop_tokens:  # the data overfills an expert: the rule is exercised
        assert int(counts.max()) > capacity
    (out.square().sum() + l_aux).backward()
    grads = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (ref_out.square().sum() + ref_l_aux).backward()
    for got, want in zip(grads, [p.grad for p in layer.parameters()], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_random_token_selection_keeps_capacity_tokens_chosen_at_random() -> None:
    logits = torch.zeros(32, 4)
    logits[:, 0] = 5.0  # every token wants expert 0; capacity 8
    kept_sets = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        _, combine, dispatch, counts = top1gating(logits, 1.0, 4, use_rts=True)
        assert counts.tolist() == [32, 0, 0, 0] and dispatch.shape == (32, 4, 8)
        kept = dispatch[:, 0].any(dim=1)
        assert int(kept.sum()) == 8 and sorted(dispatch[:, 0].nonzero()[:, 1].tolist()) == list(range(8))
        kept_sets.append(kept)
    assert not torch.equal(kept_sets[0], kept_sets[1])
    _, _, dispatch, _ = top1gating(logits, 1.0, 4, use_rts=False)
    assert dispatch[:, 0].any(dim=1).nonzero().flatten().tolist() == list(range(8))  # the first 8 by position


@pytest.mark.parametrize("policy", ["RSample", "Jitter"])
def test_noisy_gates_act_in_training_only(policy: str) -> None:
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=EXPERTS, noisy_gate_policy=policy, drop_tokens=False)
    distinct_experts(layer, 1)
    tokens = torch.randn(64, HIDDEN) * 0.05  # near-even logits: noise changes choices
    layer.eval()
    assert torch.equal(layer(tokens)[0], layer(tokens)[0])
    layer.train()
    assert not torch.equal(layer(tokens)[0], layer(tokens)[0])


def test_second_expert_sampling_varies_the_second_choice() -> None:
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=2, drop_tokens=False)
    tokens = torch.randn(64, HIDDEN) * 0.05
    assert not torch.equal(layer(tokens)[2], layer(tokens)[2])


def test_bad_arguments_are_one_line_errors() -> None:
    with pytest.raises(UsageError, match=r"num_experts=3 must be a multiple of ep_size=2"):
        MoE(HIDDEN, _expert(), num_experts=3, ep_size=2)
    with pytest.raises(UsageError, match=r"noisy_gate_policy='Gauss' is not one of"):
        MoE(HIDDEN, _expert(), num_experts=2, noisy_gate_policy="Gauss")
    with pytest.raises(ValueError, match=r"k=3 must be between 1 and num_experts=2"):
        MoE(HIDDEN, _expert(), num_experts=2, k=3)
    with pytest.raises(ValueError, match=r"3 tokens is fewer than min_capacity=4"):
        MoE(HIDDEN, _expert(), num_experts=2)(torch.randn(3, HIDDEN))
    with pytest.raises(UsageError, match=r"ep_size=2 has no expert-parallel group"):
        MoE(HIDDEN, _expert(), num_experts=2, ep_size=2)(torch.randn(8, HIDDEN))


def test_expert_parameters_carry_deepspeeds_marks() -> None:
    layer = MoE(HIDDEN, _expert(), num_experts=4, ep_size=2, use_residual=True)
    experts = layer.deepspeed_moe.experts
    assert len(experts.deepspeed_experts) == 2 and layer.num_local_experts == 2
    assert all(p.allreduce is False and p.group_name == "ep_size_2" for p in experts.parameters())
    dense = [p for n, p in layer.named_parameters() if "deepspeed_experts" not in n]
    assert dense and not any(hasattr(p, "allreduce") for p in dense)  # gate, residual mlp, coefficient


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_routes_and_the_dense_form_agree(k: int) -> None:
    """DeepSpeed's two forms of a gate's answer: ``(l_aux, capacity, E, indices, locations, gates,
    counts)`` put each kept route where the dense ``combine_weights`` has its gate."""
    torch.manual_seed(k)
    gate = MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=k, min_capacity=2, use_rts=False,
               top2_2nd_expert_sampling=False).deepspeed_moe.gate
    tokens = torch.randn(TOKENS, HIDDEN) * 2
    l_aux, combine, dispatch, counts = gate(tokens)
    sparse_l_aux, capacity, experts, indices, locations, gates, sparse_counts = gate(tokens, sparse_routes=True)
    assert torch.equal(l_aux, sparse_l_aux) and torch.equal(counts, sparse_counts) and experts == EXPERTS
    assert combine.shape == (TOKENS, EXPERTS, capacity) and torch.equal(dispatch, combine > 0)
    rebuilt = torch.zeros_like(combine)
    for route in range(k):
        for s in range(TOKENS):
            if indices[route, s] >= 0:
                rebuilt[s, indices[route, s], locations[route, s]] += gates[route, s]
    assert torch.equal(rebuilt, combine)
    assert int((indices >= 0).sum()) < TOKENS * k  # some routes were dropped


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_encode_and_decode_equal_the_dense_einsums(k: int) -> None:
    """DeepSpeed's ``_route_slots``/``_sparse_encode``/``_sparse_decode`` (``sharded_moe``) move
    tokens as the dense ``dispatch_mask``/``combine_weights`` einsums do, dropped routes included."""
    from dslaunch.moe.sharded_moe import _route_slots, _sparse_decode, _sparse_encode

    torch.manual_seed(10 + k)
    gate = MoE(HIDDEN, _expert(), num_experts=EXPERTS, k=k, min_capacity=2, use_rts=False,
               top2_2nd_expert_sampling=False).deepspeed_moe.gate
    tokens = torch.randn(TOKENS, HIDDEN) * 2
    _, combine, dispatch, _ = gate(tokens)
    _, capacity, experts, indices, locations, gates, _ = gate(tokens, sparse_routes=True)
    slots = _route_slots(indices, locations, experts, capacity)
    assert int((slots == experts * capacity).sum()) == int((indices < 0).sum()) > 0  # dropped: scratch slot
    encoded = _sparse_encode(tokens, slots, experts, capacity)
    assert torch.equal(encoded, torch.einsum("sec,sm->ecm", dispatch.to(tokens.dtype), tokens))
    expert_out = torch.randn(experts * capacity, HIDDEN).to(torch.bfloat16)
    decoded = _sparse_decode(expert_out, slots, gates, TOKENS)
    dense = torch.einsum("sec,ecm->sm", combine, expert_out.float().view(experts, capacity, HIDDEN))
    assert decoded.dtype == torch.bfloat16
    torch.testing.assert_close(decoded, dense.to(torch.bfloat16))


def test_topk_drop_policies_keep_the_likeliest_or_the_first_tokens() -> None:
    """``topkgating(drop_policy=...)``: over capacity an expert keeps its highest-gate tokens
    (``probs``, the default) or its first ones by position (``position``); others are refused."""
    from dslaunch.moe.sharded_moe import topkgating

    torch.manual_seed(3)
    logits = torch.randn(TOKENS, EXPERTS) * 3
    gates = torch.softmax(logits, dim=1)
    chosen = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, gates.topk(2, dim=1).indices, True)
    for policy in ("probs", "position"):
        _, _, dispatch, _ = topkgating(logits, 2, 0.5, 0, drop_policy=policy)
        capacity = dispatch.shape[-1]
        assert capacity == math.ceil(TOKENS / EXPERTS * 0.5 * 2)
        kept = dispatch.any(dim=2)
        for e in range(EXPERTS):
            wanted = chosen[:, e].nonzero().flatten()
            if policy == "position":
                expected = wanted[:capacity]
            else:
                expected = wanted[gates[wanted, e].argsort(descending=True)[:capacity]].sort().values
            assert torch.equal(kept[:, e].nonzero().flatten(), expected), (policy, e)
    with pytest.raises(ValueError, match="drop_policy='first'; use one of probs, position"):
        topkgating(logits, 2, 0.5, 0, drop_policy="first")
