"""Lamb through the engine: one trust ratio per original parameter at every ZeRO stage.

The engine hands the optimizer one flat tensor per param group (a shard of it at stages 1/2);
without the flat layouts Lamb would compute a single trust ratio for the whole group. Reference:
dslaunch's Lamb over the model's own parameters in one process, same global batch and clipping.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model
from tests.runtime.test_engine_equivalence import CLIP, GLOBAL, LR, STEPS, WD, _assert_close, _config, _many

LAMB = {"type": "Lamb", "params": {"lr": LR, "weight_decay": WD}}


def _lamb_reference() -> list[float]:
    from dslaunch.runtime.lamb import Lamb

    model = make_model()
    opt = Lamb(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for tokens, labels in batches(STEPS, GLOBAL):
        loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(90)
def test_lamb_stages_0_1_2_match_single_process() -> None:
    reference = _lamb_reference()
    assert reference[-4] < reference[0]  # it trains (batches cycle every 4 steps)
    configs = [_config(stage, optimizer=LAMB) for stage in (0, 1, 2)]
    for rank_results in run_world(_many, 2, configs):
        for losses in rank_results:
            _assert_close(losses, reference, 1e-5)
