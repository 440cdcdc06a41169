"""The 1-bit optimizers' steps work on cache-sized pieces: no allocation of the parameters' size.

A fresh n-sized tensor costs more than its arithmetic on CPU (its pages fault in on first touch):
the steps' time at world 4 was mostly such temporaries (BENCHMARKS.md, "1-bit optimizers").
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from dslaunch.kernels.chunks import CHUNK_NUMEL
from tests.distributed import run_world

pytestmark = pytest.mark.timeout(90)

WIDTH = 1024  # 3 layers of 1024 x 1024: ~3.1M parameters, 12 chunks of them; 1.6M (6.3 MB) per rank's shard

# (optimizer, ZeRO stage, the steps profiled: each kind of step the optimizer takes after its warm-up)
CASES = {
    "OneBitLamb": ({"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 1}}, 1, (3,)),
    "OneBitLamb-decay": ({"type": "OneBitLamb", "params": {"lr": 1e-3, "freeze_step": 1, "weight_decay": 0.01}},
                         1, (3,)),
    "OneBitAdam": ({"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1, "weight_decay": 0.01}}, 1, (3,)),
    # variance steps 1 and 3; 1-bit gradient steps 2 and 4; local steps from 5, each synchronised
    # up to 6, then every 2nd: step 4 exchanges a gradient, 6 steps and synchronises, 7 only steps
    "ZeroOneAdam": ({"type": "ZeroOneAdam", "params": {"lr": 1e-3, "var_freeze_step": 4, "var_update_scaler": 1,
                                                       "local_step_scaler": 1, "local_step_clipper": 2}},
                    0, (4, 6, 7)),
}


def _largest_allocation(rank: int, world: int, case: str) -> tuple[int, int]:
    """(largest bytes one aten op allocated in the profiled steps' optimizer step, the parameters'
    fp32 bytes)."""
    import dslaunch

    optimizer, stage, profiled = CASES[case]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(3)))
    cfg = {"train_batch_size": 2 * world, "steps_per_print": 10_000, "zero_optimization": {"stage": stage},
           "optimizer": optimizer}
    engine, _, _, _ = dslaunch.initialize(model=model, config=cfg)
    g = torch.Generator().manual_seed(rank)
    largest = 0
    for step in range(1, max(profiled) + 1):
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with profiler if step in profiled else contextlib.nullcontext() as prof:
            engine.backward(engine(torch.randn(2, WIDTH, generator=g)).square().mean())
            engine.step()
        if step in profiled:
            events = prof.events()
            (opt,) = [e for e in events if e.name.startswith(f"Optimizer.step#{optimizer['type']}")]
            largest = max([largest] + [e.self_cpu_memory_usage for e in events if e.name.startswith("aten::")
                                       and opt.time_range.start <= e.time_range.start <= opt.time_range.end])
    engine.destroy()
    return largest, 4 * sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_steps_allocate_nothing_of_the_parameters_size(case: str) -> None:
    for largest, params_bytes in run_world(_largest_allocation, 2, case):
        assert params_bytes > 12 * 4 * CHUNK_NUMEL
        # a few cache-sized buffers (2 MB), not the shard (6.3 MB: what a whole-tensor op allocates)
        assert largest < params_bytes // 4, (largest, params_bytes)
