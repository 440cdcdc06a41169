"""``MoE`` with expert parallelism on gloo, world 4: at ep 1, 2 and 4 (data parallel where ep < 4),
top-1 and top-2, with and without residual MoE and token dropping, every rank's outputs, ``l_aux``
and gradients (expert gradients summed over the expert-data group, dense ones over the world, both
divided by the world size: DeepSpeed's reduction) equal a one-process run holding every expert
that sees every rank's tokens."""

from __future__ import annotations

import pytest
import torch

from dslaunch.moe.utils import is_moe_param
from tests.distributed import run_world
from tests.runtime.moe.models import CASES, TinyMoENet, batch, expert_index

WORLD = 4


def _ranks(rank: int, world: int, ep_size: int, data_before_expert: bool) -> list[dict]:
    import torch.distributed as dist

    import dslaunch
    from dslaunch.utils import groups

    dslaunch.init_distributed(verbose=False)
    results = []
    for case in CASES:
        model = TinyMoENet(case, ep_size)
        model.moe.set_deepspeed_parallelism(data_before_expert)
        name = model.moe.expert_group_name
        first = groups._get_expert_parallel_rank(name) * model.moe.num_local_experts
        model.set_expert_weights(first)
        model(*batch(rank)).backward()
        for p in model.parameters():
            group = groups._get_expert_data_parallel_group(name) if is_moe_param(p) else None
            dist.all_reduce(p.grad, group=group)
            p.grad /= world
        grads = {expert_index(n, first): p.grad.tolist() for n, p in model.named_parameters()}
        out, l_aux = model.last
        results.append({"out": out.tolist(), "l_aux": l_aux.item(), "grads": grads})  # (tensors would
        # travel through shared memory the rank frees when it exits)
    groups.grid = None
    return results


def _reference(case, world: int) -> dict:
    """One process, every expert, each rank's tokens in turn; the loss is the ranks' mean."""
    model = TinyMoENet(case, ep_size=1)
    model.set_expert_weights(0)
    outs, total = [], 0.0
    for rank in range(world):
        total = total + model(*batch(rank)) / world
        outs.append(model.last)
    total.backward()
    return {"outs": outs, "grads": {n: p.grad for n, p in model.named_parameters()},
            "busiest": model.moe.deepspeed_moe.exp_counts.max()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("ep_size", "data_before_expert"), [(1, False), (2, False), (4, False), (2, True)])
def test_expert_parallel_layer_equals_one_process_holding_every_expert(ep_size: int, data_before_expert: bool) -> None:
    """``data_before_expert``: DeepSpeed's D + E layout (expert groups [0, 2] and [1, 3])."""
    got = run_world(_ranks, WORLD, ep_size, data_before_expert, timeout=110)
    for i, case in enumerate(CASES):
        want = _reference(case, WORLD)
        for rank in range(WORLD):
            mine = got[rank][i]
            torch.testing.assert_close(torch.tensor(mine["out"]), want["outs"][rank][0], atol=1e-6, rtol=0,
                                       msg=lambda m, c=case, r=rank: f"{c.label} rank {r} output: {m}")
            torch.testing.assert_close(torch.tensor(mine["l_aux"]), want["outs"][rank][1], atol=1e-6, rtol=0)
            expected = {n: want["grads"][n] for n in mine["grads"]}
            for n, g in mine["grads"].items():
                torch.testing.assert_close(torch.tensor(g), expected[n], atol=1e-6, rtol=0,
                                           msg=lambda m, c=case, r=rank, n=n: f"{c.label} rank {r} {n}: {m}")
        if case.drop_tokens:  # some expert is over capacity: tokens are really dropped
            capacity = max(-(-16 * case.k // 4), 2)
            assert int(want["busiest"]) > capacity, case.label


def test_use_tutel_is_off_as_in_deepspeed_without_tutel() -> None:
    """DeepSpeed's scripts (and its tests) read ``sharded_moe.TUTEL_INSTALLED`` to skip Tutel; the
    layer runs without it, as DeepSpeed's does when Tutel is not installed."""
    from dslaunch.moe import sharded_moe
    from dslaunch.moe.layer import MoE

    layer = MoE(4, torch.nn.Linear(4, 4), num_experts=2, use_tutel=True)
    assert sharded_moe.TUTEL_INSTALLED is False and layer.deepspeed_moe.use_tutel is False
