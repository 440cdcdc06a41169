"""``initialize`` starts every rank from the first rank's weights (DeepSpeed's ``_broadcast_model``):
ranks that built the model with different seeds train one model, frozen parameters included."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world


def _weights(rank: int, world: int, stage: int, train: bool) -> tuple[list, list]:
    import dslaunch

    torch.manual_seed(rank)  # each rank builds a different model
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    before = [p.detach().clone() for p in model.parameters()]
    cfg = {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 1000, "zero_optimization": {"stage": stage}}
    if train:
        cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.1}}
    engine, _, _, _ = dslaunch.initialize(model=model, config=cfg)
    params = list(engine.module.parameters())
    with dslaunch.zero.GatheredParameters(params):
        after = [p.detach().clone() for p in params]
    return before, after


@pytest.mark.timeout(150)
@pytest.mark.parametrize("stage,train", [(0, True), (1, True), (3, True), (0, False)])
def test_every_rank_starts_from_the_first_ranks_weights(stage: int, train: bool) -> None:
    (first, _), *_ = results = run_world(_weights, 2, stage, train)
    assert not all(torch.equal(a, b) for a, b in zip(first, results[1][0], strict=True))  # they did differ
    for _, after in results:
        for want, got in zip(first, after, strict=True):
            assert torch.equal(got, want)
