"""ZeRO stage 0 at world sizes 1, 2, 4 trains to the losses of plain single-process torch.

See ``equivalence.py`` for the setup; at 2 ranks also with pre-divided, unoverlapped reduction,
16-bit models and bf16 gradient communication of an fp32 model.
"""

from __future__ import annotations

import pytest

from tests.runtime.zero.equivalence import check, config, config_16bit, config_prescaled

STAGE = 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_matches_single_process(world: int, reference: list[float]) -> None:
    extra = [config_prescaled(STAGE)] if world == 2 else []
    check(world, [config(STAGE), *extra], reference, 1e-5, every_rank=True)


@pytest.mark.timeout(90)
def test_16bit_tracks_fp32(reference: list[float]) -> None:
    """bf16 and fp16 (dynamic scale from 2**8), and bf16 gradient communication of an fp32 model;
    2 ranks."""
    configs = [config_16bit(p, STAGE) for p in ("bf16", "fp16")]
    check(2, [*configs, config(STAGE, communication_data_type="bf16")], reference, 3e-2)
