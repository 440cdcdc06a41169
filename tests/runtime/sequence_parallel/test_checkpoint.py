"""An SP job's checkpoint resumes it: save after 3 steps, train 2 more; a fresh engine that loads
the checkpoint trains the same 2 steps to the same losses (sp 2 x dp 2, ZeRO 1 and 3). At another
``sequence_parallel_size`` too (sp 2 on 2 ranks to one process and back, ZeRO 1 and 3: ZeRO's
partitions span data x sequence, so the load reshards them), within float rounding (1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.sequence_parallel.test_engine import MICRO, TinyLM, samples


def _resume(rank: int, world: int, stage: int, where: str) -> tuple[list[float], list[float]]:
    import dslaunch as deepspeed
    from dslaunch.runtime.sequence_parallel.batch import shard_batch
    from dslaunch.utils import groups

    config = {"train_micro_batch_size_per_gpu": MICRO, "sequence_parallel_size": 2, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    deepspeed.init_distributed(dist_backend="gloo")

    def engine_and_steps(seed: int) -> tuple:
        torch.manual_seed(seed)
        model = TinyLM(sequence_parallel=True)
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
        model.set_group(engine.seq_parallel_group)

        def train(steps: range) -> list[float]:
            losses = []
            for step in steps:
                batch = shard_batch(samples(step, groups._get_data_parallel_rank()), groups._get_sequence_parallel_rank(), 2)
                loss = engine(**batch)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
            return losses
        return engine, train

    engine, train = engine_and_steps(0)
    train(range(3))
    engine.save_checkpoint(where)
    first = train(range(3, 5))
    engine, train = engine_and_steps(1)  # other initial weights: the checkpoint must replace them
    engine.load_checkpoint(where)
    return first, train(range(3, 5))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 3])
def test_an_sp_checkpoint_resumes_the_same_training(stage: int, tmp_path) -> None:
    for first, resumed in run_world(_resume, 4, stage, str(tmp_path), timeout=150):
        assert resumed == first


def _save_or_resume(rank: int, world: int, stage: int, where: str, save: bool) -> list[float]:
    """sp = world (one replica): train 3 steps and save, then the 2 steps after; or load and train those 2."""
    import dslaunch as deepspeed
    from dslaunch.runtime.sequence_parallel.batch import shard_batch
    from dslaunch.utils import groups

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": stage}}
    if world > 1:
        config["sequence_parallel_size"] = world
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0 if save else 1)  # other initial weights when resuming: the checkpoint must replace them
    model = TinyLM(sequence_parallel=world > 1)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    if world > 1:
        model.set_group(engine.seq_parallel_group)

    def train(steps: range) -> list[float]:
        losses = []
        for step in steps:
            loss = engine(**shard_batch(samples(step, 0), groups._get_sequence_parallel_rank(), world))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        return losses

    if save:
        train(range(3))
        engine.save_checkpoint(where)
    else:
        engine.load_checkpoint(where)
    return train(range(3, 5))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 2)], ids=["sp2-to-sp1", "sp1-to-sp2"])
def test_an_sp_checkpoint_resumes_at_another_sequence_parallel_size(stage: int, saved: int, loaded: int,
                                                                   tmp_path) -> None:
    first = run_world(_save_or_resume, saved, stage, str(tmp_path), True, timeout=150)[0]
    for resumed in run_world(_save_or_resume, loaded, stage, str(tmp_path), False, timeout=150):
        assert max(abs(a - b) for a, b in zip(resumed, first, strict=True)) < 1e-5, (first, resumed)
