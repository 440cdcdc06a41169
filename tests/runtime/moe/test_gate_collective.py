"""Without ``drop_tokens`` the gates agree on one capacity over the expert group: one MAX
all-reduce through ``deepspeed.comm`` (the comms logger counts it, as DeepSpeed's does), none when
the group has one rank. Real gloo, world 2."""

from __future__ import annotations

import pytest

from tests.distributed import run_world

pytestmark = pytest.mark.timeout(120)


def _capacities(rank: int, world: int) -> dict:
    import torch

    from dslaunch import comm, init_distributed
    from dslaunch.moe.sharded_moe import top1gating, top2gating, topkgating

    init_distributed()
    both = comm.new_group([0, 1])
    alone = [comm.new_group([r]) for r in range(world)][rank]
    # rank 0 spreads its 8 tokens evenly (token i prefers expert i % 4, then the next ones: 2, 4
    # and 6 per expert at k = 1, 2, 3); rank 1 sends every token to expert 0 first, so its count
    # of 8 is the capacity on both ranks
    spread = torch.tensor([[float(3 - (e - i) % 4) for e in range(4)] for i in range(8)])
    logits = spread if rank == 0 else torch.tensor([[9.0, 2, 1, 0]] * 8)
    gates = {"top1": lambda g: top1gating(logits, 1, 0, drop_tokens=False, use_rts=False, ep_group=g),
             "top2": lambda g: top2gating(logits, 1, 0, drop_tokens=False, ep_group=g, top2_2nd_expert_sampling=False),
             "topk": lambda g: topkgating(logits, 3, 1, 0, drop_tokens=False, ep_group=g)}
    got = {}
    for name, gate in gates.items():
        comm.configure(enabled=True, prof_all=True)
        shared = gate(both)[2].shape[-1]
        counted = sum(e["count"] for by in comm.comms_logger.summary().values() for e in by.values())
        comm.configure(enabled=False)
        comm.comms_logger.reset()
        own = gate(alone)[2].shape[-1]
        got[name] = {"shared": shared, "own": own, "counted": counted}
    return got


def test_capacity_without_dropping_is_the_group_maximum_in_one_all_reduce() -> None:
    rank0, rank1 = run_world(_capacities, 2)
    for name in ("top1", "top2", "topk"):
        assert rank0[name]["shared"] == rank1[name]["shared"] == 8, name  # rank 1's expert 0 takes all 8
        assert rank0[name]["counted"] == rank1[name]["counted"] == 1, name
        assert rank1[name]["own"] == 8, name
    assert [rank0[name]["own"] for name in ("top1", "top2", "topk")] == [2, 4, 6]
