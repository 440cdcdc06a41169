"""DeepSpeed's import paths for the pipeline, and ``initialize(training_data=...)`` feeding
``train_batch()`` through a ``RepeatingLoader`` on the stages that read data (that both stages of a
replica get the same samples from the loader is ``tests/runtime/test_mpu.py``'s)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.pipe import helpers

pytestmark = pytest.mark.timeout(90)


def test_deepspeeds_paths() -> None:
    import dslaunch
    from dslaunch.runtime.pipe import engine, module, schedule

    assert dslaunch.pipe.PipelineModule is module.PipelineModule
    assert dslaunch.pipe.LayerSpec is module.LayerSpec and dslaunch.pipe.TiedLayerSpec is module.TiedLayerSpec
    assert engine.PipelineEngine.__mro__[1] is dslaunch.DeepSpeedEngine
    assert schedule.TrainSchedule and schedule.InferenceSchedule
    assert dslaunch.utils.RepeatingLoader is dslaunch.runtime.dataloader.RepeatingLoader


def test_repeating_loader_starts_over() -> None:
    from dslaunch.utils import RepeatingLoader

    it = RepeatingLoader([1, 2, 3])
    assert [next(it) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]


def _from_training_data(rank: int, world: int) -> dict:
    import dslaunch
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5 * helpers.MICRO, helpers.WIDTH, generator=g)  # 5 micro batches: the loader restarts
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    engine, _, loader, _ = dslaunch.initialize(model=module, config=helpers.config(2, 0.01), training_data=data)
    losses = [engine.train_batch().item() for _ in range(4)]
    return {"losses": losses, "samples": engine.global_samples, "reads": engine.data_iterator is not None,
            "loader": loader is not None, "in_order": not loader.shuffle}  # as DeepSpeed's pipeline reads data


def test_training_data_feeds_train_batch() -> None:
    got = run_world(_from_training_data, 2)
    assert got[0]["losses"] == got[1]["losses"] and got[0]["samples"] == 4 * 2 * helpers.MICRO
    assert all(r["reads"] and r["loader"] and r["in_order"] for r in got)  # both stages read the same batches


def _logged(rank: int, world: int) -> list[str]:
    import dslaunch
    from dslaunch import comm
    from dslaunch.pipe import PipelineModule

    dslaunch.init_distributed(verbose=False)
    module = PipelineModule(helpers.layers(), num_stages=2, loss_fn=helpers.loss_fn)
    engine, *_ = dslaunch.initialize(model=module, config=helpers.config(2, 0.01))
    comm.configure(enabled=True)
    engine.train_batch(helpers.replica_iter(1, 2, 1, 0))
    comm.configure(enabled=False)
    return sorted(comm.log_summary(return_dict=True) or {})


def test_stage_messages_go_through_dslaunch_comm() -> None:
    """The comms logger sees them, and every wait is marked for the monitor's hang blame."""
    for ops in run_world(_logged, 2):
        assert {"isend", "irecv", "broadcast"} <= set(ops)  # (small messages travel in their head)
