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


def _object_and_list_collectives(rank: int, world: int) -> dict:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    comm.configure(enabled=True, prof_all=True)
    objects = [{"from": 0, "items": [1, 2]}] if rank == 0 else [None]
    comm.broadcast_object_list(objects, src=0)
    gathered: list = [None] * world
    comm.all_gather_object(gathered, ("rank", rank))
    outs = [torch.empty(2) for _ in range(world)]
    comm.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(world)])
    peer = 1 - rank
    got = torch.empty(3)
    ops = [comm.P2POp(dist.isend, torch.full((3,), float(rank)), peer), comm.P2POp(dist.irecv, got, peer)]
    for work in comm.batch_isend_irecv(ops):
        work.wait()
    out = [torch.empty(world * 2), torch.empty(world)]
    comm.all_gather_coalesced(out, [torch.full((2,), float(rank)), torch.tensor([rank + 0.5])])
    counted = (comm.has_comm_data(), comm.get_comm_operation_count(), sorted(comm.get_logged_comm_ops()))
    comm.reset_log()
    return {"objects": objects, "gathered": gathered, "all_to_all": [o.tolist() for o in outs], "p2p": got.tolist(),
            "coalesced": [o.tolist() for o in out], "counted": counted, "after_reset": comm.has_comm_data()}


@pytest.mark.timeout(60)
def test_object_point_to_point_and_coalesced_collectives() -> None:
    r0, r1 = run_world(_object_and_list_collectives, 2)
    for rank, r in enumerate((r0, r1)):
        assert r["objects"] == [{"from": 0, "items": [1, 2]}]
        assert r["gathered"] == [("rank", 0), ("rank", 1)]
        assert r["all_to_all"] == [[float(10 * j + rank)] * 2 for j in range(2)]
        assert r["p2p"] == [float(1 - rank)] * 3
        assert r["coalesced"] == [[0.0, 0.0, 1.0, 1.0], [0.5, 1.5]]
        has, count, names = r["counted"]
        assert has and count >= 6 and {"broadcast_object_list", "all_gather_object", "all_to_all",
                                        "batch_isend_irecv"} <= set(names), r["counted"]
        assert r["after_reset"] is False
