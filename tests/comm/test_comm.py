"""``dslaunch.comm`` (``deepspeed.comm``): torch.distributed with DeepSpeed's names and extras."""

from __future__ import annotations

import pytest
import torch

from dslaunch import comm
from dslaunch.errors import UsageError
from tests.distributed import run_world


def _collectives(rank: int, world: int) -> dict:
    import warnings

    warnings.simplefilter("error", FutureWarning)  # torch 2.13 deprecates names under DeepSpeed's
    comm.init_distributed(dist_backend="gloo", verbose=False)
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, op=comm.ReduceOp.SUM, prof=True, log_name="x", debug="y")  # DeepSpeed's extras
    maxed = torch.tensor([float(rank)])
    comm.all_reduce(maxed, op=comm.ReduceOp.MAX)
    gathered = torch.empty(world)
    comm.allgather_fn(gathered, torch.tensor([float(rank)]))
    shard = torch.empty(1)
    comm.reduce_scatter_fn(shard, torch.ones(world) * (rank + 1))
    into = torch.empty(world)
    comm.all_gather_into_tensor(into, torch.tensor([float(rank) * 2]))
    scattered = torch.empty(1)
    comm.reduce_scatter_tensor(scattered, torch.arange(float(world)))
    pair = [torch.tensor([1.0]), torch.tensor([2.0])]
    comm.all_reduce_coalesced(pair)
    src = torch.tensor([float(rank)])
    comm.broadcast(src, 0)
    comm.barrier()
    return {"sum": t.item(), "max": maxed.item(), "gathered": gathered.tolist(), "shard": shard.item(), "into": into.tolist(), "scattered": scattered.item(),
            "pair": [p.item() for p in pair], "bcast": src.item(), "rank": comm.get_rank(),
            "world": comm.get_world_size(), "local": comm.get_local_rank(),
            "ranks": comm.get_all_ranks_from_group(), "init": comm.is_initialized()}


def _barrier_with_a_late_peer(rank: int, world: int) -> list:
    import os
    import time

    from dslaunch.utils.beat import Beat

    beats_r, beats_w = os.pipe()
    os.environ["DSLAUNCH_HEARTBEAT_FD"] = str(beats_w)  # as dslaunch starts a worker
    comm.init_distributed(dist_backend="gloo", verbose=False)  # starts the heartbeat
    if rank == 1:
        time.sleep(2.0)
    comm.barrier()
    time.sleep(1.5)  # the beat after the barrier (sent within a tick, 0.5 s, when not loaded)
    os.set_blocking(beats_r, False)
    lines = os.read(beats_r, 1 << 20).splitlines()
    return [(b.waiting, b.waiting_s) for b in map(Beat.from_line, lines)]


@pytest.mark.timeout(60)
def test_a_rank_in_a_collective_says_so_in_its_heartbeat() -> None:
    """On a hang the monitor blames the rank that is not waiting (``launcher/monitor/health``)."""
    waiter, _ = run_world(_barrier_with_a_late_peer, 2)
    assert any(w == "barrier" and s > 0 for w, s in waiter), waiter  # sent while it waited 2 s
    assert waiter[-1] == (None, None), waiter  # out of it once the peer came


@pytest.mark.timeout(60)
def test_collectives_and_queries_at_two_ranks() -> None:
    r0, r1 = run_world(_collectives, 2)
    for rank, r in enumerate((r0, r1)):
        assert r["sum"] == 3.0 and r["max"] == 1.0 and r["gathered"] == [0.0, 1.0]
        assert r["shard"] == 3.0 and r["pair"] == [2.0, 4.0] and r["bcast"] == 0.0
        assert r["into"] == [0.0, 2.0] and r["scattered"] == 2.0 * rank
        assert (r["rank"], r["world"], r["local"], r["ranks"], r["init"]) == (rank, 2, rank, [0, 1], True)


def _queries_before_init(rank: int, world: int) -> str:
    assert not comm.is_initialized()
    with pytest.raises(UsageError, match=r"deepspeed.comm.get_rank\(\).*init_distributed"):
        comm.get_rank()
    return "ok"


@pytest.mark.timeout(60)
def test_queries_before_init_name_the_call_to_make() -> None:
    assert run_world(_queries_before_init, 1) == ["ok"]
