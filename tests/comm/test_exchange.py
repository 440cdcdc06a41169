"""The gradient exchanges and the 1-bit compressed all-reduce on gloo ranks.

- packbits/unpackbits round-trip the signs, 8 to a byte;
- the compressed all-reduce leaves the same result on every rank, the same bits through the fused
  kernels (C on CPU) as through the torch reference, sends >= 30x fewer bytes than an
  fp32 all-reduce (the comms logger's payloads, times each collective's share that leaves the
  rank), and its error feedback makes the average of repeated exchanges converge to the true mean;
- the hierarchical all-reduce (2 nodes x 2 ranks) equals the flat one within fp32 rounding, and
  ``build_exchange`` picks it only where ranks share nodes; an engine trains the same with either.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.distributed import run_world


def test_packbits_round_trips_signs() -> None:
    from dslaunch.kernels.reference import packbits, unpackbits

    x = torch.randn(64)
    packed = packbits(x >= 0)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    torch.testing.assert_close(unpackbits(packed), torch.where(x >= 0, 1.0, -1.0))
    assert packbits(torch.tensor([True] + [False] * 7)).item() == 128  # first element in the high bit


def _sent_bytes(summary: dict, world: int) -> float:
    """Bytes a rank sends, from the logged payloads: the share of each collective that leaves it."""
    share = {"all_reduce": 2 * (world - 1) / world, "all_to_all_single": (world - 1) / world,
             "all_gather_into_tensor": world - 1}
    return sum(share[op] * size * row["count"] for op, sizes in summary.items() for size, row in sizes.items())


def _compressed(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch import comm
    from dslaunch.runtime.optim.compression import compressed_all_reduce, padded_numel

    dist.init_process_group("gloo")
    n = padded_numel(1 << 16, world)
    x = torch.randn(n, generator=torch.Generator().manual_seed(rank))
    mean = x.clone()
    dist.all_reduce(mean)
    mean /= world
    worker, server = torch.zeros(n), torch.zeros(n // world)
    comm.configure(enabled=True)
    comm.comms_logger.reset()
    out = compressed_all_reduce(x.clone(), worker, server, world)
    compressed = _sent_bytes(comm.comms_logger.summary(), world)
    comm.configure(enabled=False)
    total = out.clone()
    for _ in range(49):  # error feedback: the running average of the exchanges approaches the mean
        total += compressed_all_reduce(x.clone(), worker, server, world)
    same = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(same, out)
    return {"identical": all(torch.equal(s, out) for s in same), "fused_is_reference": _fused_is_reference(x, world),
            "fp32_bytes": 2 * (world - 1) / world * 4 * n,
            "compressed_bytes": compressed, "one_shot_error": float((out - mean).norm() / mean.norm()),
            "averaged_error": float((total / 50 - mean).norm() / mean.norm())}


def _fused_is_reference(x: torch.Tensor, world: int) -> bool:
    """Three exchanges (errors carried) through the fused kernels (C on CPU) and through the torch
    reference: the same bits, errors included."""
    from dslaunch.runtime.optim.compression import compressed_all_reduce

    runs = []
    for mode in ("fused", "reference"):
        os.environ["DSLAUNCH_KERNELS"] = mode
        worker, server = torch.zeros_like(x), torch.zeros(x.numel() // world)
        outs = [compressed_all_reduce(x.mul(k + 1), worker, server, world) for k in range(3)]
        runs.append([*outs, worker, server])
    del os.environ["DSLAUNCH_KERNELS"]
    return all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 4])
def test_compressed_all_reduce_agrees_sends_30x_less_and_feeds_back_its_error(world: int) -> None:
    for r in run_world(_compressed, world):
        assert r["identical"] and r["fused_is_reference"]
        assert r["fp32_bytes"] / r["compressed_bytes"] >= 30, r
        assert r["one_shot_error"] > 0.3  # one exchange is only a sign and a scale ...
        assert r["averaged_error"] < 0.1, r  # ... but the errors are carried, not lost


def _hierarchical(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from dslaunch.runtime.zero.exchange import FlatAllReduce, HierarchicalAllReduce, build_exchange

    os.environ["NODE_RANK"] = str(rank // 2)  # 2 nodes of 2 ranks
    dist.init_process_group("gloo")
    # the nodes are simulated on one host, where shared memory would take every rank: pinned off
    picked = build_exchange(False, "topology", shared_memory="never")
    x = torch.randn(10_001, generator=torch.Generator().manual_seed(rank))
    flat, hier = x.clone(), x.clone()
    FlatAllReduce().all_reduce(flat).wait()
    assert isinstance(picked, HierarchicalAllReduce)
    picked.all_reduce(hier)
    # through the engine (ZeRO-1, buckets of whole parameters): the same training within rounding
    from tests.runtime.optim.onebit_task import build, config, run_steps

    adam = {"type": "Adam", "params": {"lr": 1e-2}}
    runs = {}
    for mode in ("topology", "never"):
        engine = build(config(adam, 1, hierarchical_allreduce=mode, shared_memory_collectives="never"))
        runs[mode] = (type(engine.zero.exchange).__name__, run_steps(engine, rank, world, 0, 5))
        engine.destroy()
    os.environ["NODE_RANK"] = "0"  # one node: flat is the only sensible choice
    one_node = build_exchange(False, "topology", shared_memory="never")
    return {"picked": picked.name, "one_node": one_node.name, "max_diff": float((flat - hier).abs().max()),
            "scale": float(flat.abs().max()), "engine": runs}


@pytest.mark.timeout(120)
def test_hierarchical_all_reduce_equals_flat_within_fp32_rounding() -> None:
    for r in run_world(_hierarchical, 4):
        assert (r["picked"], r["one_node"]) == ("hierarchical", "flat")
        assert r["max_diff"] <= 4 * torch.finfo(torch.float32).eps * r["scale"], r
        (hier_name, hier_losses), (flat_name, flat_losses) = r["engine"]["topology"], r["engine"]["never"]
        assert (hier_name, flat_name) == ("HierarchicalAllReduce", "FlatAllReduce")
        assert hier_losses == pytest.approx(flat_losses, rel=1e-5)
