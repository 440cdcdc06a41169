"""Lamb through the engine: one trust ratio per original parameter at every ZeRO stage.

The engine hands the optimizer one flat tensor per param group (a shard of it at stages 1/2);
without the flat layouts Lamb would compute a single trust ratio for the whole group. Reference:
dslaunch's Lamb over the model's own parameters in one process, same global batch and clipping.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.zero.equivalence import LR, WD, assert_close, config, many, reference_losses

LAMB = {"type": "Lamb", "params": {"lr": LR, "weight_decay": WD}}


def _lamb(params) -> torch.optim.Optimizer:
    from dslaunch.runtime.optim.lamb import Lamb

    return Lamb(params, lr=LR, weight_decay=WD)


@pytest.mark.timeout(90)
def test_lamb_stages_0_1_2_match_single_process() -> None:
    reference = reference_losses(make_optimizer=_lamb)
    assert reference[-4] < reference[0]  # it trains (batches cycle every 4 steps)
    configs = [config(stage, optimizer=LAMB) for stage in (0, 1, 2)]
    for rank_results in run_world(many, 2, configs):
        for losses in rank_results:
            assert_close(losses, reference, 1e-5)
