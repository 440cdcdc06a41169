"""An MoE layer's experts count the work of the tokens routed to them (kept within capacity),
not every slot of every expert: a layer whose routing is known by construction."""

from __future__ import annotations

import pytest
import torch

from dslaunch.moe.layer import MoE
from dslaunch.profiling.flops_profiler import FlopsProfiler

pytestmark = pytest.mark.timeout(60)

HIDDEN, FFN, EXPERTS = 4, 6, 4
# token j goes to expert ROUTE[j]: 5, 1, 2 and 0 tokens; capacity ceil(8 / 4) = 2 keeps 2, 1, 2, 0
ROUTE = [0, 0, 0, 0, 0, 1, 2, 2]
KEPT = 5


def _layer() -> MoE:
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.Linear(FFN, HIDDEN))
    moe = MoE(HIDDEN, expert, num_experts=EXPERTS, k=1, capacity_factor=1.0, min_capacity=0, use_rts=False)
    with torch.no_grad():  # the router's logit for expert e is 10 x the token's e-th coordinate
        moe.deepspeed_moe.gate.wg.weight.copy_(torch.eye(EXPERTS) * 10)
    return moe


def test_the_experts_count_only_the_tokens_routed_to_them_within_capacity() -> None:
    moe = _layer()
    tokens = torch.eye(HIDDEN)[ROUTE].requires_grad_()
    prof = FlopsProfiler(moe)
    prof.start_profile()
    out, _, exp_counts = moe(tokens)
    out.sum().backward()
    prof.stop_profile()
    assert exp_counts.tolist() == [5, 1, 2, 0]
    rows = {row.name: row for row in prof.profile().rows}
    experts = rows["deepspeed_moe.experts"]
    per_token = 2 * HIDDEN * FFN * 2  # two Linears, 2 flops per multiply-accumulate
    assert experts.fwd_flops == KEPT * per_token  # not 4 experts x 2 slots = 8 tokens' work
    assert experts.bwd_flops == 2 * KEPT * per_token  # each Linear's input and weight gradients
    router = 2 * len(ROUTE) * HIDDEN * EXPERTS  # the router's logits, in the layer's own count
    layer = rows["deepspeed_moe"]
    assert layer.own_fwd_flops == router and layer.fwd_flops == router + experts.fwd_flops
    assert prof.get_total_flops() == layer.fwd_flops + layer.bwd_flops
