"""An SP job's checkpoint resumes it: save after 3 steps, train 2 more; a fresh engine that loads
the checkpoint trains the same 2 steps to the same losses (sp 2 x dp 2, ZeRO 1 and 3)."""

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
