"""OneBitLamb's compressed step works on cache-sized pieces: no allocation of the parameters' size.

A fresh n-sized tensor costs more than its arithmetic on CPU (its pages fault in on first touch):
the step's time at world 4 was mostly such temporaries (BENCHMARKS.md, "1-bit optimizers").
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.runtime.optim.chunks import CHUNK_NUMEL
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(90)

WIDTH = 1024  # 3 layers of 1024 x 1024: ~3.1M parameters, 12 chunks of them; 1.6M (6.3 MB) per rank's shard


def _largest_allocation(rank: int, world: int, weight_decay: float) -> tuple[int, int]:
    """(largest bytes one aten op allocated in a compressed step, the parameters' fp32 bytes)."""
    import dslaunch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(3)))
    cfg = {"train_batch_size": 2 * world, "steps_per_print": 10_000, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 1,
                                                         "weight_decay": weight_decay}}}
    engine, _, _, _ = dslaunch.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        engine.backward(engine(torch.randn(2, WIDTH, generator=g)).square().mean())
        engine.step()

    for _ in range(2):  # the warm-up step, then the first compressed one (it sets up the frozen state)
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = prof.events()
    (opt,) = [e for e in events if e.name.startswith("Optimizer.step#OneBitLamb")]
    inside = [e for e in events if e.name.startswith("aten::")
              and opt.time_range.start <= e.time_range.start <= opt.time_range.end]
    largest = max(e.self_cpu_memory_usage for e in inside)
    engine.destroy()
    return largest, 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_onebit_lamb_compressed_step_allocates_nothing_of_the_parameters_size(weight_decay: float) -> None:
    for largest, params_bytes in run_world(_largest_allocation, 2, weight_decay):
        assert params_bytes > 12 * 4 * CHUNK_NUMEL
        # a few cache-sized buffers (2 MB), not the shard (6.3 MB: what a whole-tensor op allocates)
        assert largest < params_bytes // 4, (largest, params_bytes)
