"""``gradient_allreduce_op``: "sum" adds the data-parallel ranks' gradients, "mean" (default)
averages them; DeepSpeed's spellings and refusals."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from tests.distributed import run_world
from tests.runtime.models import batches, make_model


def _deltas(rank: int, world: int, stage: int, op: str) -> list[list[float]]:
    import dslaunch

    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
           "gradient_allreduce_op": op, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": stage}}
    engine, _, _, _ = dslaunch.initialize(model=make_model(), config=cfg)
    tokens, labels = next(iter(batches(1, 2 * world)))
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(tokens[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]))
    engine.step()
    engine.zero.synchronize()
    return [(p.detach() - b).flatten().tolist() for p, b in zip(engine.module.parameters(), before, strict=True)]


def _both(rank: int, world: int, stage: int) -> tuple:
    return _deltas(rank, world, stage, "mean"), _deltas(rank, world, stage, "SUM")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage", [0, 2])
def test_sum_is_world_times_the_mean(stage: int) -> None:
    mean, summed = run_world(_both, 2, stage)[0]
    for m, s in zip(mean, summed, strict=True):
        # deltas are differences of fp32 weights: their last bits are rounding, hence rtol 1e-3
        assert torch.allclose(torch.tensor(s), 2 * torch.tensor(m), rtol=1e-3, atol=1e-6)
    assert any(abs(x) > 0 for m in mean for x in m)


def test_spellings_and_refusals() -> None:
    assert load_config({"train_batch_size": 2}, 1).gradient_allreduce_op == "mean"
    assert load_config({"train_batch_size": 2, "gradient_allreduce_op": "Sum"}, 1).gradient_allreduce_op == "sum"
    with pytest.raises(ConfigError, match="Invalid gradient_allreduce_op 'max'"):
        load_config({"train_batch_size": 2, "gradient_allreduce_op": "max"}, 1)
    with pytest.raises(ConfigError, match="not supported with ZeRO stage 3"):
        load_config({"train_batch_size": 2, "gradient_allreduce_op": "sum", "zero_optimization": {"stage": 3}}, 1)
