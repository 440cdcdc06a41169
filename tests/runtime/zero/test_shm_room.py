"""Shared-memory collectives where the segment directory is too small (a container's 64 MiB
``/dev/shm``): the job still trains, with the same bits, on private buffers through the slots, or
on gloo where even the slots do not fit; rank 0 says which, naming the directory.

A real tmpfs of a chosen size is mounted for the test (root), pointed at with ``DSLAUNCH_SHM_DIR``.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from tests.distributed import run_world

WIDTH = 1100  # 1.2M weights: 9.7 MB of a shared buffer at world 2, more than the room left


@pytest.fixture
def small_tmpfs(tmp_path: Path):
    mounted = tmp_path / "shm"
    mounted.mkdir()

    def mount(size: str) -> Path:
        opts = f"size={size}" + (",remount" if os.path.ismount(mounted) else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(mounted)],
                              capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.strip()}")
        return mounted

    yield mount
    if os.path.ismount(mounted):
        subprocess.run(["umount", "-l", str(mounted)], check=False)


def _train(rank: int, world: int, directory: str, stage: int) -> dict:
    os.environ.pop("DSLAUNCH_SHM_COLLECTIVES", None)  # the config decides
    os.environ["DSLAUNCH_SHM_DIR"] = directory
    import torch

    import dslaunch

    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("DeepSpeed").addHandler(handler)
    out: dict = {"said": said}
    for setting in ("on", "never"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 2))
        engine, *_ = dslaunch.initialize(model=model, config={
            "train_batch_size": 2 * world, "shared_memory_collectives": setting,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": stage}})
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            engine.backward(engine(torch.randn(2, WIDTH, generator=g)).square().mean())
            engine.step()
        with dslaunch.zero.GatheredParameters(list(model.parameters())):
            out[stage, setting] = [p.detach().reshape(-1)[:64].tolist() for p in model.parameters()]
        exchange = engine.zero.exchange
        gatherer = getattr(getattr(model[0].weight, "_dsl_flat", None), "gatherer", None)
        out[stage, setting, "how"] = (exchange.name, len(getattr(exchange, "buffers", [])),
                                       type(gatherer).__name__)
    out["left"] = os.listdir(directory)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 3])
def test_no_room_for_the_buffers_keeps_them_private_with_the_same_bits(small_tmpfs, stage: int) -> None:
    # 2 transports x 32 MiB of slots fit, the model's shared buffers (9.7 MB, shards 4.8 MB) do not
    directory = small_tmpfs("66m")
    for rank, r in enumerate(run_world(_train, 2, str(directory), stage, timeout=170)):
        assert r[stage, "on"] == r[stage, "never"]  # bit for bit (world 2: gloo's sum)
        assert r[stage, "on", "how"][:2] == ("shared_memory", 0)  # no shared gradient buffer
        if stage == 3:
            assert r[3, "on", "how"][2] == "SharedMemoryGather"
        assert r["left"] == []
        if rank == 0:
            assert any(f"{directory} has no room for a shared buffer" in m and "private memory" in m
                       for m in r["said"]), r["said"]


@pytest.mark.timeout(180)
def test_no_room_for_the_slots_is_gloo(small_tmpfs) -> None:
    directory = small_tmpfs("16m")
    for rank, r in enumerate(run_world(_train, 2, str(directory), 1, timeout=170)):
        assert r[1, "on"] == r[1, "never"]
        assert r[1, "on", "how"][0] == r[1, "never", "how"][0] == "flat"
        if rank == 0:
            assert any(f"{directory} has no room for the slots" in m and "gloo" in m for m in r["said"]), r["said"]
