"""ZeRO stage 1 at world sizes 1, 2, 4 trains to the losses of plain single-process torch.

See ``equivalence.py`` for the setup; also a client optimizer and scheduler, and 16-bit models at
2 and 4 ranks (partitions cut through parameters).
"""

from __future__ import annotations

import pytest

from tests.runtime.zero.equivalence import check, config, config_16bit

STAGE = 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_fp32_matches_single_process(world: int, reference: list[float]) -> None:
    check(world, [config(STAGE)], reference, 1e-5, every_rank=True)


@pytest.mark.timeout(60)
def test_client_optimizer_and_scheduler(reference: list[float]) -> None:
    """A torch optimizer and LR scheduler passed to initialize()."""
    check(2, [config(STAGE)], reference, 1e-5, client=True)


@pytest.mark.timeout(90)
def test_16bit_tracks_fp32(reference: list[float]) -> None:
    """bf16 and fp16 (dynamic scale from 2**8); 2 ranks."""
    check(2, [config_16bit(p, STAGE) for p in ("bf16", "fp16")], reference, 3e-2)


@pytest.mark.timeout(90)
def test_16bit_at_four_ranks(reference: list[float]) -> None:
    """bf16 on 4 ranks: partitions cut through parameters, one rank per micro batch sample."""
    check(4, [config_16bit("bf16", STAGE)], reference, 3e-2)
