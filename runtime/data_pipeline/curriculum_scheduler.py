"""``deepspeed.runtime.data_pipeline.curriculum_scheduler``: DeepSpeed's (legacy) curriculum
learning schedule, the difficulty (e.g. the sequence length) at each optimizer step.

``CurriculumScheduler(params)`` takes the ds_config's ``curriculum_learning`` block (with or without
``enabled``; the keys are ``runtime/config/curriculum.py``'s). The engine makes one when the block is
enabled (``engine.curriculum_scheduler_legacy``), moves it on at each training forward to the step
about to be taken, and passes ``curriculum_seqlen=<difficulty>`` to the model where
``curriculum_type`` is ``"seqlen"``; Megatron-DeepSpeed also makes its own.

The difficulty is a function of the step, so a resumed job gets it back from ``global_steps`` (the
scheduler is not in the checkpoint, as in DeepSpeed); ``get_state``/``set_state`` carry it for
scripts that save it themselves. Once it reached ``max_difficulty`` it stays there.

Differences from DeepSpeed: a bad block is one line naming the key (DeepSpeed asserts, or fails at
the first forward: ``curriculum_type`` missing, a custom schedule without its function);
``schedule_config`` keys another schedule type would take are refused, not ignored; fixed_discrete's
``max_step`` must rise; and fixed_linear/fixed_root never go below ``min_difficulty`` (DeepSpeed
rounds down to a multiple of ``difficulty_step``, so ``min_difficulty`` 1 with step 8 gave 0).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

from dslaunch.errors import ConfigError, UsageError
from dslaunch.runtime.config.curriculum import CurriculumLearningConfig, Schedule
from dslaunch.runtime.config.param_schema import describe
from dslaunch.runtime.config.sections import parse_section
from dslaunch.utils.logging import log_dist

__all__ = ["CurriculumScheduler", "difficulty_at", "legacy_scheduler"]

_KEY = "curriculum_learning"


def difficulty_at(schedule: Schedule, low: int, high: int, step: int) -> int:
    """The difficulty of optimizer step ``step`` (counted from 1) under a fixed schedule."""
    if schedule.kind == "fixed_discrete":
        for difficulty, last in zip(schedule.difficulty, schedule.max_step, strict=False):
            if step <= last:
                return difficulty
        return schedule.difficulty[-1]
    reached = (step / schedule.total_curriculum_step) ** (1.0 / schedule.root_degree)
    value = math.floor(reached * (high - low) + low)
    value -= value % schedule.difficulty_step  # a multiple of the step (8 for fp16 tensor cores)
    return max(low, min(value, high))


class CurriculumScheduler:
    """The difficulty schedule of a ``curriculum_learning`` block.

    ``state`` holds DeepSpeed's keys: ``min_difficulty``, ``max_difficulty``,
    ``current_difficulty``, ``schedule_type``, ``schedule_config``.

    Raises:
        ConfigError: a bad block (one line naming the key).
    """

    def __init__(self, config: Mapping[str, Any] | CurriculumLearningConfig):
        self.first_step = True  # DeepSpeed's pipeline engine reads and clears it
        self.custom_get_difficulty: Callable[[int], int] | None = None
        self.state: dict[str, Any] = {}
        parsed = _parsed(config)
        self.curriculum_type = parsed.curriculum_type  # "seqlen": the engine passes curriculum_seqlen
        self._load(parsed, None)

    @property
    def schedule(self) -> Schedule:
        """The validated schedule (``schedule_type`` and ``schedule_config``)."""
        return self._schedule

    def get_current_difficulty(self) -> int:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        """The ``custom`` schedule's function: optimizer step -> difficulty."""
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: Mapping[str, Any]) -> None:
        """A state from ``get_state`` (checked as a config block is)."""
        keys = ("min_difficulty", "max_difficulty", "schedule_type", "schedule_config")
        self._load(_parsed({k: state[k] for k in keys if k in state}), state.get("current_difficulty"))

    def _load(self, config: CurriculumLearningConfig, current: int | None) -> None:
        self._schedule = config.schedule(engine=False)  # every key there and consistent
        self.state = {"min_difficulty": config.min_difficulty, "max_difficulty": config.max_difficulty,
                      "current_difficulty": config.min_difficulty if current is None else current,
                      "schedule_type": config.schedule_type, "schedule_config": dict(config.schedule_config or {})}

    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at optimizer step ``global_steps`` (from 1)."""
        if self._schedule.kind != "custom":
            return difficulty_at(self._schedule, self.state["min_difficulty"], self.state["max_difficulty"],
                                 global_steps)
        if self.custom_get_difficulty is None:
            raise UsageError(f"{_KEY}.schedule_type: 'custom' needs its function: call "
                             "set_custom_get_difficulty(fn) on the scheduler (engine.curriculum_scheduler_legacy) "
                             "before the first training forward")
        return self.custom_get_difficulty(global_steps)

    def forward_kwargs(self, kwargs: dict[str, Any], global_steps: int) -> dict[str, Any]:
        """A training forward's ``kwargs`` at step ``global_steps`` (the one about to be taken): with
        ``curriculum_seqlen`` where ``curriculum_type`` is ``"seqlen"``, as DeepSpeed's engine passes it."""
        difficulty = self.update_difficulty(global_steps)
        return {**kwargs, "curriculum_seqlen": difficulty} if self.curriculum_type == "seqlen" else kwargs

    def update_difficulty(self, global_steps: int) -> int:
        """Move on to step ``global_steps``; the difficulty never falls back from ``max_difficulty``."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]


def legacy_scheduler(config: CurriculumLearningConfig, half_precision: bool) -> CurriculumScheduler | None:
    """The engine's scheduler for an enabled block (None when off); says once, on rank 0, where a
    seqlen step would defeat half precision's tensor cores (DeepSpeed warns on every rank)."""
    if not config.enabled:
        return None
    scheduler = CurriculumScheduler(config)
    step = scheduler.schedule.difficulty_step
    if half_precision and config.curriculum_type == "seqlen" and scheduler.schedule.kind in ("fixed_linear", "fixed_root") \
            and step % 8:
        log_dist(f"{_KEY}.schedule_config.difficulty_step: {step} is not a multiple of 8, so sequence lengths "
                 "miss the tensor cores' sizes in fp16/bf16 (16 for int8)", ranks=[0], level=logging.WARNING)
    return scheduler


def _parsed(config: Mapping[str, Any] | CurriculumLearningConfig) -> CurriculumLearningConfig:
    if isinstance(config, CurriculumLearningConfig):
        return config
    if not isinstance(config, Mapping):
        raise ConfigError(f"must be an object of settings (the ds_config's block), got {describe(config)}", key=_KEY)
    return parse_section(CurriculumLearningConfig, {**config, "enabled": True}, _KEY)
