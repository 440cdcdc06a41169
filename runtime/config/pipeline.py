"""The ds_config ``pipeline`` block: DeepSpeed's keys for pipeline parallelism, plus ``schedule``.

``{"pipeline": {"schedule": "1f1b", "activation_checkpoint_interval": 1}}``

Read by the pipeline engine (``runtime/pipe/engine.py``) when the model is a ``PipelineModule``;
a model that is not one ignores the block, as DeepSpeed does. As in DeepSpeed the
``PipelineModule``'s own arguments decide the partition and the layer seeds: ``partition``,
``seed_layers``, ``pipe_partitioned`` and ``grad_partitioned`` are checked and change nothing
(the last two matter only with tensor slices, which dslaunch's pipeline does not have).
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer
from dslaunch.runtime.config.sections import _opt
from dslaunch.runtime.pipe.schedule import SCHEDULES, schedule_choices

__all__ = ["PipelineConfig"]


def _stages(path: str, value: Any) -> str | int:
    if value == "auto":
        return value
    return integer(1)(path, value)


def _partition(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"must be a partition method (\"best\", \"parameters\", \"uniform\" or \"type:<regex>\"), "
                          f"got {describe(value)}", key=path)
    return value


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: the training schedule and activation checkpointing of a ``PipelineModule``."""

    stages: str | int = _opt("auto", _stages, "\"auto\" or the PipelineModule's number of stages")
    """Checked against the ``PipelineModule``'s stages when given as a number."""
    activation_checkpoint_interval: int = _opt(0, integer(0), "layers per checkpointed chunk, e.g. 1 (0: off)")
    """Used when the ``PipelineModule`` was built with interval 0 (its own argument wins)."""
    use_reentrant: bool = _opt(True, boolean, "false to checkpoint with non_reentrant_checkpoint")
    """DeepSpeed's: false swaps the ``PipelineModule``'s checkpoint function for
    ``deepspeed.checkpointing.non_reentrant_checkpoint`` (whatever the interval: a later
    ``set_checkpoint_interval`` uses it too); true keeps the module's own."""
    schedule: str = _opt("1f1b", choice(*SCHEDULES), f"a schedule: {schedule_choices()}")
    """dslaunch's key: the training schedule from ``runtime/pipe/schedule.py``'s registry."""

    # DeepSpeed's keys whose say belongs to the PipelineModule (or to tensor slices): checked, no effect.
    INERT = {"partition": _partition, "seed_layers": boolean,  # noqa: RUF012
             "pipe_partitioned": boolean, "grad_partitioned": boolean}
    UNIMPLEMENTED = {}  # noqa: RUF012
    AUTO_OK = ("stages",)
