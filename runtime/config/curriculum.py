"""The ds_config ``curriculum_learning`` block: DeepSpeed's (legacy) curriculum learning by step.

``{"curriculum_learning": {"enabled": true, "curriculum_type": "seqlen", "min_difficulty": 8,
"max_difficulty": 1024, "schedule_type": "fixed_linear", "schedule_config":
{"total_curriculum_step": 40000, "difficulty_step": 8}}}``

The difficulty grows from ``min_difficulty`` to ``max_difficulty`` with the optimizer step, by one
of four schedules (``schedule_config``'s keys depend on it):

- ``fixed_linear``: ``total_curriculum_step``, ``difficulty_step``;
- ``fixed_root``: the same and ``root_degree`` (2: square root);
- ``fixed_discrete``: ``difficulty`` (a list) and ``max_step`` (one fewer: the last step of each
  difficulty but the last);
- ``custom``: a function the script hands the scheduler (``set_custom_get_difficulty``).

The engine passes the difficulty to the model's forward as ``curriculum_seqlen`` when
``curriculum_type`` is ``"seqlen"`` (``runtime/data_pipeline/curriculum_scheduler.py``).
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import (
    REQUIRED,
    Option,
    boolean,
    check_params,
    choice,
    describe,
    integer,
    number,
)
from dslaunch.runtime.config.sections import _opt, optional

__all__ = ["CurriculumLearningConfig", "Schedule", "SCHEDULE_TYPES", "parse_schedule"]

SCHEDULE_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_KEY = "curriculum_learning"


def _text(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a name such as \"seqlen\" (the difficulty the model's forward receives as "
                          f"curriculum_seqlen), got {describe(value)}", key=path)
    return value


def _mapping(path: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"must be an object of the schedule's settings, got {describe(value)}", key=path)
    return value


def _integers(low: int) -> Any:
    def check(path: str, value: Any) -> tuple[int, ...]:
        if not isinstance(value, list | tuple) or not value:
            raise ConfigError(f"must be a non-empty list of integers, got {describe(value)}", key=path)
        return tuple(integer(low)(f"{path}[{i}]", v) for i, v in enumerate(value))

    return check


@dataclass(frozen=True)
class Schedule:
    """A validated ``schedule_type`` with its ``schedule_config``."""

    kind: str
    total_curriculum_step: int = 1
    difficulty_step: int = 1
    root_degree: float = 1.0  # fixed_linear: 1
    difficulty: tuple[int, ...] = ()
    max_step: tuple[int, ...] = ()


_STEPS = {"total_curriculum_step": Option(REQUIRED, integer(1)), "difficulty_step": Option(REQUIRED, integer(1))}
_SCHEMAS = {
    "fixed_linear": _STEPS,
    "fixed_root": {**_STEPS, "root_degree": Option(REQUIRED, number(0.0, low_open=True))},
    "fixed_discrete": {"difficulty": Option(REQUIRED, _integers(0)), "max_step": Option(REQUIRED, _integers(1))},
    "custom": {},
}


def parse_schedule(kind: str, settings: Mapping[str, Any] | None, prefix: str = _KEY) -> Schedule:
    """``schedule_config`` checked against ``kind``'s keys (unknown keys refused, as DeepSpeed's are
    ignored), fixed_discrete's lists consistent.

    Raises:
        ConfigError: naming ``<prefix>.schedule_config.<key>``.
    """
    path = f"{prefix}.schedule_config"
    params = check_params(settings, _SCHEMAS[kind], path, f"schedule_type '{kind}'")
    if kind == "fixed_discrete":
        difficulty, max_step = params["difficulty"], params["max_step"]
        if len(difficulty) != len(max_step) + 1:
            raise ConfigError(f"has {len(max_step)} steps for {len(difficulty)} difficulties; give one fewer "
                              "max_step than difficulty (the last difficulty holds to the end)", key=f"{path}.max_step")
        if any(b <= a for a, b in zip(max_step, max_step[1:], strict=False)):
            raise ConfigError(f"must rise step by step, got {list(max_step)}", key=f"{path}.max_step")
    return Schedule(kind, **params)


@dataclass(frozen=True)
class CurriculumLearningConfig:
    """``curriculum_learning``: the difficulty (e.g. sequence length) rises with the step."""

    enabled: bool = _opt(False, boolean, "true or false")
    curriculum_type: str | None = _opt(None, optional(_text), "\"seqlen\": the model's forward gets "
                                       "curriculum_seqlen=<difficulty>")
    min_difficulty: int | None = _opt(None, optional(integer(0)), "an integer: the first step's difficulty")
    max_difficulty: int | None = _opt(None, optional(integer(0)), "an integer: the difficulty at the schedule's end")
    schedule_type: str | None = _opt(None, optional(choice(*SCHEDULE_TYPES)), "one of " + ", ".join(SCHEDULE_TYPES))
    schedule_config: Mapping[str, Any] | None = _opt(None, optional(_mapping), "the schedule's settings")

    UNIMPLEMENTED = {}  # noqa: RUF012

    def schedule(self, prefix: str = _KEY, engine: bool = True) -> Schedule:
        """The validated schedule of an enabled block. ``engine``: ``curriculum_type`` is required too
        (the engine decides by it whether the forward gets ``curriculum_seqlen``).

        Raises:
            ConfigError: a required key missing, min above max, or a bad ``schedule_config``.
        """
        needed = ("curriculum_type",) * engine + ("min_difficulty", "max_difficulty", "schedule_type")
        for key in needed:
            if getattr(self, key) is None:
                raise ConfigError(f"is required with curriculum learning enabled ({_fields_help(key)})",
                                  key=f"{prefix}.{key}")
        if self.min_difficulty > self.max_difficulty:
            raise ConfigError(f"{self.min_difficulty} is above max_difficulty {self.max_difficulty}",
                              key=f"{prefix}.min_difficulty")
        return parse_schedule(self.schedule_type, self.schedule_config, prefix)

    def check(self) -> None:
        if self.enabled:
            self.schedule()


def _fields_help(key: str) -> str:
    return CurriculumLearningConfig.__dataclass_fields__[key].metadata["help"]
