"""Shared-memory collectives where the segment directory is small (a container's 64 MiB
``/dev/shm``): the slots are what the model's groups can need (a tiny model's, a few KiB, so it
uses shared memory at 4 ranks in 64 MiB), measured as the tmpfs's used pages and the ranks'
mappings; where the directory is too small the job still trains, with the same bits, on private
buffers through the slots, or on gloo where even the slots do not fit; rank 0 says which, naming
the directory.

A real tmpfs of a chosen size is mounted for the test (root), pointed at with ``DSLAUNCH_SHM_DIR``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil

import pytest

from tests.distributed import run_world
from tests.runtime.zero.held import shared_segments

WIDTH = 1100  # 1.2M weights: 9.7 MB of a shared buffer at world 2, more than the room left
TINY = 24  # 650 weights
PAGE = 4096


def _segments(directory: str) -> list[tuple[str, int]]:
    """This process's mappings of segments in ``directory``: each one's tag (``zero``: slots,
    ``zero-buf``: shared buffers) and length, sorted."""
    return sorted(("zero-buf" if "dslaunch-shm-zero-buf-" in path else "zero", hi - lo)
                  for path, lo, hi in shared_segments(directory))


def _train(rank: int, world: int, directory: str, stage: int, width: int = WIDTH) -> dict:
    os.environ.pop("DSLAUNCH_SHM_COLLECTIVES", None)  # the config decides
    os.environ["DSLAUNCH_SHM_DIR"] = directory
    import torch
    import torch.distributed as dist

    import dslaunch

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("DeepSpeed").addHandler(handler)
    out: dict = {"said": said}
    for setting in ("on", "never"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 2))
        engine, *_ = dslaunch.initialize(model=model, config={
            "train_batch_size": 2 * world, "shared_memory_collectives": setting,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}})
        if setting == "on":
            dist.barrier()  # every rank mapped every segment (they were unlinked then)
            out["used"], out["mapped"] = shutil.disk_usage(directory).used, _segments(directory)
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            engine.backward(engine(torch.randn(2, width, generator=g)).square().mean())
            engine.step()
        with dslaunch.zero.GatheredParameters(list(model.parameters())):
            out[stage, setting] = [p.detach().reshape(-1)[:64].tolist() for p in model.parameters()]
        exchange, placement = engine.zero.exchange, engine.zero.placement
        gatherer = getattr(getattr(model[0].weight, "_dsl_flat", None), "gatherer", None)
        out[stage, setting, "how"] = (exchange.name, len(getattr(exchange, "buffers", [])),
                                       type(gatherer).__name__)
        out[stage, setting, "publish"] = (getattr(placement, "shm", None) is not None,
                                           len(getattr(placement, "shared", [])))
    out["left"] = os.listdir(directory)
    return out


def _expected_segments(stage: int, world: int, numel: int) -> list[tuple[str, int]]:
    """The segments a one-group fp32 model of ``numel`` weights maps at ``stage``: slots of what one
    operation can move (8 MiB at most, 64-byte multiples, two sets per rank), page-rounded."""
    def pages(n: int) -> int:
        return -(-n // PAGE) * PAGE

    def slots(piece: int) -> tuple[str, int]:
        return "zero", pages(2 * world * min(8 << 20, max(64, -(-piece // 64) * 64)))

    shard = math.ceil(numel / world)
    whole = shard * world  # the group padded for the ranks
    out = [slots(whole * 4)]  # the gradient exchange: a bucket holds at most the whole group
    if stage in (1, 2):  # the publish: slots of one rank's shard, the flat weights shared
        out += [slots(shard * 4), ("zero-buf", pages(world * whole * 4))]
    if stage == 1:  # the whole gradient shared
        out += [("zero-buf", pages(world * whole * 4))]
    if stage == 3:  # the shards shared, gathers read them in place: no slots, only the waits
        out += [slots(0), ("zero-buf", pages(world * shard * 4))]
    return sorted(out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_tiny_model_reserves_what_its_groups_need_and_fits_64_mib_at_world_4(small_tmpfs, stage: int) -> None:
    # before: 2 x 4 ranks x 8 MiB of slots per group, so in 64 MiB the publish (or stage 3's
    # gathers) and every shared buffer fell back to gloo / private memory
    directory = small_tmpfs("64m")
    numel = TINY * TINY + TINY + TINY * 2 + 2
    expected = _expected_segments(stage, 4, numel)
    for r in run_world(_train, 4, str(directory), stage, TINY, timeout=230):
        assert r["mapped"] == expected, (r["mapped"], expected)  # the kernel's mappings of this rank
        assert r["used"] == sum(n for _, n in expected)  # the tmpfs's pages: nothing else reserved
        assert r[stage, "on", "how"][:2] == ("shared_memory", 1 if stage == 1 else 0)
        assert r[stage, "on", "publish"] == ((True, 1) if stage in (1, 2) else (False, 0))
        assert r[stage, "on", "how"][2] == ("SharedShards" if stage == 3 else "NoneType")
        assert not any("has no room" in m for m in r["said"]), r["said"]
        for got, gloo in zip(r[stage, "on"], r[stage, "never"], strict=True):
            assert got == pytest.approx(gloo, rel=1e-5, abs=1e-6)  # world 4: another sum order than gloo's
        assert r["left"] == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("stage", "room"), [(1, "32m"), (3, "22m")])
def test_no_room_for_the_buffers_keeps_them_private_with_the_same_bits(small_tmpfs, stage: int, room: str) -> None:
    # stage 1: the slots (exchange 18.5 MiB, publish 9.3 MiB) fit, the flat weights and gradient
    # (9.3 MiB each) do not; stage 3: the exchange's slots fit, the shards (4.6 MiB) do not, nor the
    # slots a gather through them would need (9.3 MiB): gloo gathers
    directory = small_tmpfs(room)
    for rank, r in enumerate(run_world(_train, 2, str(directory), stage, timeout=170)):
        assert r[stage, "on"] == r[stage, "never"]  # bit for bit (world 2: gloo's sum)
        assert r[stage, "on", "how"][:2] == ("shared_memory", 0)  # no shared gradient buffer
        if stage == 1:
            assert r[1, "on", "publish"] == (True, 0)  # the publish through the slots
        if stage == 3:
            assert r[3, "on", "how"][2] == "NoneType"
        assert r["left"] == []
        if rank == 0:
            assert any(f"{directory} has no room for a shared buffer" in m and "private memory" in m
                       for m in r["said"]), r["said"]
            if stage == 3:
                assert any(f"{directory} has no room for the slots" in m for m in r["said"]), r["said"]


@pytest.mark.timeout(180)
def test_no_room_for_the_slots_is_gloo(small_tmpfs) -> None:
    directory = small_tmpfs("16m")
    for rank, r in enumerate(run_world(_train, 2, str(directory), 1, timeout=170)):
        assert r[1, "on"] == r[1, "never"]
        assert r[1, "on", "how"][0] == r[1, "never", "how"][0] == "flat"
        if rank == 0:
            assert any(f"{directory} has no room for the slots" in m and "gloo" in m for m in r["said"]), r["said"]
