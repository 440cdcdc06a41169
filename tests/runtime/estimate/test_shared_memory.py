"""The estimator's shared memory (``MemoryEstimate.shm``: what ``/dev/shm`` must hold, ``docker run
--shm-size``) against real jobs: 2 gloo ranks on one host, the 5 configurations of
``test_memory.py`` with ``shared_memory_collectives`` on (the default), each in a tmpfs of its own
(``DSLAUNCH_SHM_DIR``). The tmpfs's used bytes once the engine is built are the estimate's
``shm`` (within ``SHM_TOLERANCE``), and the rank's private tensors (those outside the shared
segments) its ``device`` plus its share of ``host`` (within ``PRIVATE_TOLERANCE``): the shared
buffers, and stage 3's parameters that are views of the shared shards, are counted once, in ``shm``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from dslaunch.runtime.estimate import TrainingSetup, estimate_memory
from tests.distributed import run_world
from tests.runtime.estimate.test_memory import ADAMW, BATCH, CONFIGS, WIDTH, _build, _shape

SHM_TOLERANCE = 0.01  # measured: exact to the byte (whole pages on both sides)
PRIVATE_TOLERANCE = 0.01  # measured: within 16 bytes (the optimizer's step counters); test_memory allows 10%


def _job(rank: int, world: int, directory: str, cfg: dict) -> tuple[int, int]:
    os.environ.pop("DSLAUNCH_SHM_COLLECTIVES", None)  # the config decides (on by default)
    os.environ["DSLAUNCH_SHM_DIR"] = directory
    import torch
    import torch.distributed as dist

    from tests.runtime.estimate.peak import engine_peak

    used: list[int] = []

    def built(engine: object) -> None:
        dist.barrier()  # every rank mapped every segment
        used.append(shutil.disk_usage(directory).used)
    torch.manual_seed(0)
    peak = engine_peak(_build(), {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
                                  "optimizer": ADAMW, **cfg},
                       lambda dtype: torch.randn(BATCH, WIDTH, dtype=dtype), private=True, on_start=built)
    return used[0], peak


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("name", "cfg"), CONFIGS, ids=[name for name, _ in CONFIGS])
def test_shm_need_is_what_the_job_maps_and_private_memory_counts_the_rest(small_tmpfs, name: str, cfg: dict) -> None:
    directory = small_tmpfs("64m")
    est = estimate_memory(_shape(), cfg, gpus_per_node=2, accelerator="cpu", micro_batch=BATCH)
    gloo = estimate_memory(_shape(), {**cfg, "shared_memory_collectives": "never"}, gpus_per_node=2,
                           accelerator="cpu", micro_batch=BATCH)
    assert gloo.shm.total == 0 < est.shm.total
    assert est.device.total < gloo.device.total  # the shared buffers left private memory
    for used, private in run_world(_job, 2, str(directory), cfg, timeout=100):
        assert abs(used - est.shm.total) <= SHM_TOLERANCE * used, (name, used, est.shm)
        mine = est.device.total + est.host.total // 2
        assert abs(mine - private) <= PRIVATE_TOLERANCE * private, (name, mine, private, est.device, est.host)


def test_shared_memory_applies_to_cpu_ranks_of_one_host_and_follows_the_config() -> None:
    shape = _shape()
    cpu = TrainingSetup(stage=1, gpus_per_node=4, accelerator="cpu")
    assert estimate_memory(shape, cpu).shm.total > 0
    for off in (cpu.with_(accelerator="cuda"), cpu.with_(nodes=2), cpu.with_(gpus_per_node=1),
                cpu.with_(shared_memory=False), TrainingSetup.from_ds_config(
                    {"shared_memory_collectives": "never", "zero_optimization": {"stage": 1}},
                    gpus_per_node=4, accelerator="cpu")):
        assert estimate_memory(shape, off).shm.total == 0, off
    assert TrainingSetup.from_ds_config({"shared_memory_collectives": "auto"}).shared_memory
    # two pipeline stages: two data-parallel groups of 2 on the host, each its own segments
    piped = estimate_memory(shape, cpu.with_(pipeline=2))
    assert piped.shm.total > 0 and piped.setup.data_parallel == 2


def test_slot_bound_is_the_engines() -> None:
    from dslaunch.runtime.estimate import memory
    from dslaunch.runtime.zero import shm

    assert memory.SLOT_BYTES == shm.SLOT_BYTES
