"""MoE through ``deepspeed.initialize`` on gloo, world 4: 20 training steps at ZeRO 0, 2 and 3, with
gradient clipping active, experts spread over 2 and 4 ranks give, on every rank, the losses of the
run where every rank holds every expert (ep 1), within 1e-6."""

from __future__ import annotations

import pytest

from tests.distributed import run_world
from tests.runtime.moe.models import MoECase, TinyMoENet, clipped_losses

WORLD, STEPS = 4, 20
ENGINE_CASES = [MoECase(1, False, True), MoECase(2, True, False)]


def _train(rank: int, world: int, ep_size: int, stage: int) -> list[list[float]]:
    from dslaunch.utils import groups

    runs = []
    for case in ENGINE_CASES:
        model = TinyMoENet(case, ep_size)
        model.set_expert_weights((rank % ep_size) * model.moe.num_local_experts)  # DeepSpeed's E + D layout
        runs.append(clipped_losses(model, stage, rank, STEPS))
        assert groups._get_expert_parallel_rank(model.moe.expert_group_name) == rank % ep_size
    groups.grid = None
    return runs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])  # stage 0's expert reduction: tests/runtime/zero/test_experts.py
def test_training_at_ep_2_and_4_gives_the_losses_of_ep_1(stage: int) -> None:
    dense = run_world(_train, WORLD, 1, stage, timeout=120)
    for ep_size in (2, 4):
        expert = run_world(_train, WORLD, ep_size, stage, timeout=120)
        for rank in range(WORLD):
            for case, want, got in zip(ENGINE_CASES, dense[rank], expert[rank], strict=True):
                worst = max(abs(a - b) for a, b in zip(want, got, strict=True))
                assert worst <= 1e-6, f"ep {ep_size} rank {rank} {case.label}: losses differ by {worst:.2e}"
    assert dense[0][0][0] != dense[0][0][-1]  # it trains


@pytest.mark.timeout(200)
def test_experts_no_rank_routes_to_do_not_stall_zero3() -> None:
    """Routing forced so that experts 2 and 3 (both on expert rank 1) get no token from any rank
    and expert 1 none from even ranks: 20 ZeRO-3 steps finish on every rank
    (``scripts/bench/moe_starve.py`` runs 500)."""
    from tests.runtime.moe.models import starving_counts, train_starving

    results = run_world(train_starving, WORLD, 20, 120.0, timeout=180)
    for rank, got in enumerate(results):
        assert got["counts"] == [starving_counts(rank)] * 2, got["counts"]
        assert len(got["losses"]) == 20 and all(x == x for x in got["losses"])
