"""ZeRO stage 3 at world sizes 1, 2, 4 trains to the losses of plain single-process torch.

See ``equivalence.py`` for the setup (2 accumulation micro steps, active clipping, tiny buckets).
``stage3_param_persistence_threshold: 0`` partitions every parameter; the default keeps the tiny
model whole (persistent) and must train alike. 16-bit models at 2 and 4 ranks.
"""

from __future__ import annotations

import pytest

from tests.runtime.zero.equivalence import check, config, config_16bit

STAGE = 3


def config3(**zero) -> dict:
    cfg = config(STAGE)
    cfg["zero_optimization"].update({"stage3_param_persistence_threshold": 0, **zero})
    return cfg


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_matches_single_process(world: int, reference: list[float]) -> None:
    extra = [config(STAGE), config3(overlap_comm=False)] if world == 2 else []
    check(world, [config3(), *extra], reference, 1e-5, every_rank=True)


@pytest.mark.timeout(90)
def test_16bit_tracks_fp32(reference: list[float]) -> None:
    """bf16 and fp16 (dynamic scale from 2**8) on 2 ranks, fp16 on 4."""
    configs = [config_16bit(p, STAGE) for p in ("bf16", "fp16")]
    for c in configs:
        c["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    check(2, configs, reference, 3e-2)
    check(4, configs[1:], reference, 3e-2)
