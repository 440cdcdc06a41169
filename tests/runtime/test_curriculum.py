"""DeepSpeed's (legacy) curriculum learning: the ``curriculum_learning`` block's schedules, the
engine passing ``curriculum_seqlen`` to the model's training forward, the pipeline engine moving
the schedule on, a resumed job getting the schedule back from its step, and bad blocks refused in
one line."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler
from tests.distributed import run_world

LINEAR = {"curriculum_type": "seqlen", "min_difficulty": 2, "max_difficulty": 10, "schedule_type": "fixed_linear",
          "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2}}
# DeepSpeed's own expectations for these two blocks (its TestLegacyCurriculumScheduler), step -> difficulty
LINEAR_STEPS = {1: 2, 2: 4, 3: 4, 4: 6, 5: 6, 6: 8, 7: 8, 8: 10, 9: 10, 10: 10}
DISCRETE = {"min_difficulty": 1, "max_difficulty": 5, "schedule_type": "fixed_discrete",
            "schedule_config": {"difficulty": [1, 2, 3, 4, 5], "max_step": [2, 4, 6, 8]}}
DISCRETE_STEPS = {1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 4, 8: 4, 9: 5, 10: 5}


def _walk(block: dict, steps: int = 10) -> dict[int, int]:
    scheduler = CurriculumScheduler(block)
    return {step: scheduler.update_difficulty(step) for step in range(1, steps + 1)}


def test_fixed_schedules_give_deepspeeds_difficulties() -> None:
    assert _walk(LINEAR) == LINEAR_STEPS
    assert _walk({**DISCRETE, "enabled": True}) == DISCRETE_STEPS  # the ds_config block as given


def test_fixed_root_rises_as_the_root_of_the_step() -> None:
    block = {**LINEAR, "min_difficulty": 8, "max_difficulty": 1024, "schedule_type": "fixed_root",
             "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8, "root_degree": 2}}
    walked = _walk(block, 120)
    for step in (1, 25, 50, 99):  # 8 + sqrt(step / 100) * 1016, down to a multiple of 8
        exact = 8 + (step / 100) ** 0.5 * 1016
        assert walked[step] % 8 == 0 and exact - 8 < walked[step] <= exact
    assert walked[100] == walked[120] == 1024
    assert list(walked.values()) == sorted(walked.values())


def test_the_difficulty_never_falls_below_the_minimum() -> None:
    # DeepSpeed rounds 1 down to a multiple of 8: a sequence length of 0
    block = {**LINEAR, "min_difficulty": 1, "max_difficulty": 64,
             "schedule_config": {"total_curriculum_step": 100, "difficulty_step": 8}}
    assert _walk(block, 3) == {1: 1, 2: 1, 3: 1}


def test_custom_schedule_uses_the_scripts_function_and_holds_at_the_maximum() -> None:
    scheduler = CurriculumScheduler({"min_difficulty": 0, "max_difficulty": 30, "schedule_type": "custom"})
    with pytest.raises(UsageError, match="set_custom_get_difficulty"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: 10 * step)
    assert [scheduler.update_difficulty(s) for s in (1, 2, 3, 4, 1)] == [10, 20, 30, 30, 30]


def test_state_round_trips_and_is_checked() -> None:
    scheduler = CurriculumScheduler(LINEAR)
    scheduler.update_difficulty(4)
    again = CurriculumScheduler(DISCRETE)
    again.set_state(scheduler.get_state())
    assert again.get_current_difficulty() == 6 and again.update_difficulty(8) == 10
    with pytest.raises(ConfigError, match="schedule_config.difficulty_step"):
        again.set_state({**scheduler.get_state(), "schedule_config": {"total_curriculum_step": 8}})


@pytest.mark.parametrize(("block", "key", "says"), [
    ({"enabled": True}, "curriculum_learning.curriculum_type", "required"),
    ({**LINEAR, "enabled": True, "schedule_type": "fixed_linaer"}, "curriculum_learning.schedule_type",
     "did you mean 'fixed_linear'"),
    ({**LINEAR, "enabled": True, "schedule_type": "fixed_root"}, "curriculum_learning.schedule_config.root_degree",
     "required"),
    ({**LINEAR, "enabled": True, "min_difficulty": 12}, "curriculum_learning.min_difficulty", "above max_difficulty"),
    ({**DISCRETE, "curriculum_type": "seqlen", "enabled": True,
      "schedule_config": {"difficulty": [1, 2], "max_step": [3, 4]}},
     "curriculum_learning.schedule_config.max_step", "one fewer"),
    ({**DISCRETE, "curriculum_type": "seqlen", "enabled": True,
      "schedule_config": {"difficulty": [1, 2, 3], "max_step": [4, 4]}},
     "curriculum_learning.schedule_config.max_step", "must rise"),
    ({**LINEAR, "enabled": True, "schedule_config": {"total_curriculum_step": 8, "difficulty_stpe": 2}},
     "curriculum_learning.schedule_config.difficulty_stpe", "did you mean 'difficulty_step'"),
])
def test_a_bad_block_is_one_line_naming_its_key(block: dict, key: str, says: str) -> None:
    from dslaunch.runtime.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config({"train_batch_size": 2, "curriculum_learning": block}, 1)
    assert f"'{key}'" in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def test_a_disabled_block_is_not_checked() -> None:
    from dslaunch.runtime.config import load_config

    assert not load_config({"train_batch_size": 2, "curriculum_learning": {"enabled": False}}, 1) \
        .curriculum_learning.enabled


class _SeqModel(torch.nn.Module):
    """Records the ``curriculum_seqlen`` of every forward and reads only that many positions."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(4, 1)
        self.seen: list[int | None] = []

    def forward(self, x: torch.Tensor, curriculum_seqlen: int | None = None) -> torch.Tensor:
        self.seen.append(curriculum_seqlen)
        return self.lin(x[:, :curriculum_seqlen]).square().mean()


def _config(curriculum_type: str = "seqlen") -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": {"stage": 2},
            "curriculum_learning": {**LINEAR, "enabled": True, "curriculum_type": curriculum_type}}


def _micro_steps(engine, count: int) -> None:
    g = torch.Generator().manual_seed(engine.global_rank)
    for _ in range(count):
        engine.backward(engine(torch.randn(2, 16, 4, generator=g)))
        engine.step()


def _train(rank: int, world: int, save_dir: str) -> dict:
    import dslaunch

    out: dict = {}
    model = _SeqModel()
    engine, *_ = dslaunch.initialize(model=model, config=_config())
    out["names"] = (engine.curriculum_enabled_legacy(), engine.curriculum_params_legacy())
    _micro_steps(engine, 6)  # optimizer steps 1-3, two micro steps each
    engine.eval()
    engine(torch.zeros(2, 16, 4))
    engine.train()
    out["seen"] = list(model.seen)
    engine.save_checkpoint(save_dir, tag="three")

    resumed_model = _SeqModel()
    resumed, *_ = dslaunch.initialize(model=resumed_model, config=_config())
    resumed.load_checkpoint(save_dir, tag="three")
    _micro_steps(resumed, 2)  # step 4
    out["resumed"] = list(resumed_model.seen)

    other_model = _SeqModel()
    other, *_ = dslaunch.initialize(model=other_model, config=_config("tokens"))
    _micro_steps(other, 4)
    out["other"] = (list(other_model.seen), other.curriculum_scheduler_legacy.get_current_difficulty())
    return out


@pytest.mark.timeout(120)
def test_the_engine_passes_the_steps_seqlen_to_training_forwards_and_resumes_it(tmp_path) -> None:
    for r in run_world(_train, 2, str(tmp_path / "ckpt"), timeout=110):
        assert r["names"] == (True, LINEAR)
        # two micro steps per optimizer step, then an evaluation forward: no curriculum there
        assert r["seen"] == [LINEAR_STEPS[1]] * 2 + [LINEAR_STEPS[2]] * 2 + [LINEAR_STEPS[3]] * 2 + [None]
        assert r["resumed"] == [LINEAR_STEPS[4]] * 2  # from global_steps, as DeepSpeed (not saved)
        assert r["other"] == ([None] * 4, LINEAR_STEPS[2])  # scheduled, not passed


def _pipeline(rank: int, world: int) -> list[int]:
    import dslaunch
    from dslaunch.pipe import PipelineModule
    from tests.runtime.pipe.helpers import layers, loss_fn, replica_iter

    dslaunch.init_distributed()
    module = PipelineModule(layers(), num_stages=2, loss_fn=loss_fn)
    config = {**_config(), "zero_optimization": {"stage": 0}}
    engine, *_ = dslaunch.initialize(model=module, config=config)
    data = replica_iter(3, 2, 1, 0)
    difficulties = []
    for _ in range(3):
        engine.train_batch(data)
        difficulties.append(engine.curriculum_scheduler_legacy.get_current_difficulty())
    return difficulties


@pytest.mark.timeout(120)
def test_the_pipeline_engine_moves_the_schedule_on_each_batch() -> None:
    for difficulties in run_world(_pipeline, 2, timeout=110):
        assert difficulties == [LINEAR_STEPS[1], LINEAR_STEPS[2], LINEAR_STEPS[3]]
