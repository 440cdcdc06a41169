"""Learning-rate schedules named by ds_config's ``scheduler.type``, with DeepSpeed's params.

DeepSpeed's module path (``deepspeed.runtime.lr_schedules``). Owns the registry of schedules
(``schedules.py``: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest), their accepted
``scheduler.params`` (names and defaults as DeepSpeed's) and the step semantics DeepSpeed users
rely on:

- ``last_batch_iteration`` counts scheduler steps, starting at -1. Building a schedule at -1
  writes the schedule's starting lr into the optimizer; each ``step()`` increments the counter
  and writes the lr for the new value (the engine calls it once per applied optimizer step).
- ``state_dict()`` is ``{"last_batch_iteration": n}``; ``load_state_dict`` restores it and
  re-applies that iteration's lr.
- Scalars apply to every param group; lists give one value per group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean, quote
from dslaunch.runtime.config.param_schema import (
    REQUIRED,
    Option,
    boolean,
    check_params,
    choice,
    integer,
    number,
    number_or_list,
)
from dslaunch.runtime.lr_schedules.schedules import (
    LRRangeTest,
    OneCycle,
    Schedule,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

__all__ = ["SCHEDULER_TYPES", "VALID_LR_SCHEDULES", "SchedulerSpec", "validate_lr_scheduler", "build_lr_scheduler", "WarmupLR",
           "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest",
           "LR_SCHEDULE", "LR_RANGE_TEST", "ONE_CYCLE", "WARMUP_LR", "WARMUP_DECAY_LR", "WARMUP_COSINE_LR", "EDGE_VALUE", "MID_VALUE", "LR_RANGE_TEST_MIN_LR", "LR_RANGE_TEST_STEP_RATE", "LR_RANGE_TEST_STEP_SIZE", "LR_RANGE_TEST_STAIRCASE", "CYCLE_FIRST_STEP_SIZE", "CYCLE_FIRST_STAIR_COUNT", "CYCLE_SECOND_STEP_SIZE", "CYCLE_SECOND_STAIR_COUNT", "DECAY_STEP_SIZE", "CYCLE_MIN_LR", "CYCLE_MAX_LR", "DECAY_LR_RATE", "CYCLE_MIN_MOM", "CYCLE_MAX_MOM", "DECAY_MOM_RATE", "WARMUP_MIN_LR", "WARMUP_MAX_LR", "WARMUP_NUM_STEPS", "WARMUP_TYPE", "WARMUP_LOG_RATE", "WARMUP_LINEAR_RATE", "WARMUP_MIN_RATIO", "COS_MIN_RATIO", "TOTAL_NUM_STEPS"]

_KEY = "scheduler.params"

# DeepSpeed's names for the schedule types and their params (scripts build scheduler dicts with them).
LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR = "LRRangeTest", "OneCycle", "WarmupLR"
WARMUP_DECAY_LR, WARMUP_COSINE_LR = "WarmupDecayLR", "WarmupCosineLR"
EDGE_VALUE, MID_VALUE = "edge_value", "mid_value"
LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE = "lr_range_test_min_lr", "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE = "lr_range_test_step_size", "lr_range_test_staircase"
CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT = "cycle_first_step_size", "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT = "cycle_second_step_size", "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"
CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE = "cycle_min_lr", "cycle_max_lr", "decay_lr_rate"
CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE = "cycle_min_mom", "cycle_max_mom", "decay_mom_rate"
WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS = "warmup_min_lr", "warmup_max_lr", "warmup_num_steps"
WARMUP_TYPE, WARMUP_LOG_RATE, WARMUP_LINEAR_RATE = "warmup_type", "log", "linear"
WARMUP_MIN_RATIO, COS_MIN_RATIO, TOTAL_NUM_STEPS = "warmup_min_ratio", "cos_min_ratio", "total_num_steps"

_WARMUP_TYPE = choice("log", "linear")
_START = Option(-1, integer(-1))
# Written into Adam's betas[0]: 1 would divide by zero in its bias correction.
_MOMENTUM = number_or_list(0.0, 1.0, high_open=True)


def _warmup_schema(max_lr_default: Any) -> dict[str, Option]:
    return {
        "warmup_min_lr": Option(0.0, number_or_list(0.0)),
        "warmup_max_lr": Option(max_lr_default, number_or_list(0.0)),
        "warmup_num_steps": Option(1000, integer(1)),
        "warmup_type": Option("log", _WARMUP_TYPE),
        "last_batch_iteration": _START,
    }


@dataclass(frozen=True)
class _Entry:
    cls: Callable[..., Schedule]
    schema: Mapping[str, Option]


_REGISTRY: dict[str, _Entry] = {
    "WarmupLR": _Entry(WarmupLR, _warmup_schema(None)),
    "WarmupDecayLR": _Entry(WarmupDecayLR, {"total_num_steps": Option(REQUIRED, integer(1)),
                                            **_warmup_schema(0.001)}),
    "WarmupCosineLR": _Entry(WarmupCosineLR, {
        "total_num_steps": Option(REQUIRED, integer(1)),
        "warmup_min_ratio": Option(0.0, number(0.0, 1.0)),
        "warmup_num_steps": Option(1000, integer(1)),
        "cos_min_ratio": Option(0.0001, number(0.0, 1.0)),
        "warmup_type": Option("log", _WARMUP_TYPE),
        "last_batch_iteration": _START,
    }),
    "OneCycle": _Entry(OneCycle, {
        "cycle_min_lr": Option(REQUIRED, number_or_list(0.0)),
        "cycle_max_lr": Option(REQUIRED, number_or_list(0.0)),
        "decay_lr_rate": Option(0.0, number(0.0)),
        "cycle_first_step_size": Option(2000, integer(1)),
        "cycle_second_step_size": Option(None, integer(0)),
        "cycle_first_stair_count": Option(0, integer(0)),
        "cycle_second_stair_count": Option(None, integer(0)),
        "decay_step_size": Option(0, integer(0)),
        "cycle_momentum": Option(True, boolean),
        "cycle_min_mom": Option(0.8, _MOMENTUM),
        "cycle_max_mom": Option(0.9, _MOMENTUM),
        "decay_mom_rate": Option(0.0, number(0.0)),
        "last_batch_iteration": _START,
    }),
    "LRRangeTest": _Entry(LRRangeTest, {
        "lr_range_test_min_lr": Option(1e-3, number_or_list(0.0)),
        "lr_range_test_step_size": Option(2000, integer(1)),
        "lr_range_test_step_rate": Option(1.0, number(0.0)),
        "lr_range_test_staircase": Option(False, boolean),
        "last_batch_iteration": _START,
    }),
}
_BY_LOWER = {name.lower(): name for name in _REGISTRY}

SCHEDULER_TYPES: tuple[str, ...] = tuple(_REGISTRY)
# DeepSpeed's name for it: accelerate tests a scheduler's class name against this list.
VALID_LR_SCHEDULES: list[str] = list(SCHEDULER_TYPES)


@dataclass(frozen=True)
class SchedulerSpec:
    """A validated scheduler config: canonical type name and complete keyword arguments."""

    name: str
    params: Mapping[str, Any]


def validate_lr_scheduler(sched_type: str, params: Mapping[str, Any] | None) -> SchedulerSpec:
    """Check ``scheduler.type`` and ``scheduler.params`` without an optimizer.

    Args:
        sched_type: ds_config ``scheduler.type`` (DeepSpeed's spelling; case is forgiven).
        params: ds_config ``scheduler.params``.

    Returns:
        The canonical type name and all parameters with defaults filled in.

    Raises:
        ConfigError: unknown type (valid ones listed, did-you-mean), unknown or missing parameter,
            wrong type or range; the message names ``scheduler.params.<key>``.
    """
    name = _BY_LOWER.get(sched_type.lower()) if isinstance(sched_type, str) else None
    if name is None:
        hint = did_you_mean(sched_type, _REGISTRY) if isinstance(sched_type, str) else ""
        raise ConfigError(f"unknown scheduler type {quote(sched_type)}{hint}; valid types: "
                          f"{', '.join(SCHEDULER_TYPES)}, or pass a scheduler to initialize()",
                          key="scheduler.type")
    checked = check_params(params, _REGISTRY[name].schema, _KEY, f"scheduler {name!r}")
    return SchedulerSpec(name, checked)


def build_lr_scheduler(spec: SchedulerSpec, optimizer: Any) -> Schedule:
    """Build the schedule a validated spec names and write its starting lr into ``optimizer``.

    Args:
        spec: from ``validate_lr_scheduler`` (done once, when the config was parsed).
        optimizer: a ``torch.optim.Optimizer`` (or a wrapper exposing ``.optimizer``).

    Returns:
        An object with ``step()``, ``get_lr()``, ``get_last_lr()``, ``state_dict()``,
        ``load_state_dict()``.

    Raises:
        ConfigError: per-group lists whose length differs from the optimizer's number of param
            groups.
    """
    return _REGISTRY[spec.name].cls(optimizer, **spec.params)
