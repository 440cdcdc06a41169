"""``deepspeed.runtime.data_pipeline.data_routing.scheduler``: random-LTD's schedule of how many
tokens the dropping layers keep.

The kept length rises from ``min_value`` to ``max_value`` over ``require_steps`` optimizer steps
(``fixed_linear``, a multiple of ``seq_per_step``), as DeepSpeed's ``RandomLTDScheduler``; the
engine moves it at each training forward. ``consumed_layer_tokens`` counts the tokens the layers
processed (the dropping layers at the kept length, the others at ``max_value``), per global batch.
Its ``state_dict`` is in the engine's checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dslaunch.errors import NotInDslaunchError

__all__ = ["BaseScheduler", "RandomLTDScheduler"]

_SAVED = ("consumed_layer_tokens", "current_steps", "current_value", "min_value", "max_value")


class BaseScheduler:
    """The fixed-root/linear value of a step (``state`` holds DeepSpeed's keys)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def _fixed_root_value(self, global_steps: int, root_degree: float) -> int:
        settings = self.state["schedule_config"]
        reached = (float(global_steps) / settings["require_steps"]) ** (1.0 / root_degree)
        low, high = self.state["min_value"], self.state["max_value"]
        value = math.floor(reached * (high - low) + low)
        value -= value % settings["seq_per_step"]
        return min(value, high)

    def get_value(self, global_steps: int) -> int:
        """The kept length at optimizer step ``global_steps``.

        Raises:
            NotInDslaunchError: a schedule type other than ``fixed_linear`` (DeepSpeed has only it).
        """
        if self.state["schedule_type"] != "fixed_linear":
            raise NotInDslaunchError(f"random_ltd.random_ltd_schedule.schedule_type {self.state['schedule_type']!r}: "
                                     "only 'fixed_linear' is a random-LTD schedule")
        return self._fixed_root_value(global_steps, 1)


class RandomLTDScheduler(BaseScheduler):
    """The kept length of random-LTD's layers, step by step.

    Args:
        config: the ``random_ltd`` block (DeepSpeed's keys) with ``global_batch_size`` added.

    Raises:
        NotInDslaunchError: ``layer_token_lr_schedule`` enabled (DeepSpeed raises too: work in progress).
    """

    def __init__(self, config: Mapping[str, Any]):
        super().__init__()
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        if (config.get("layer_token_lr_schedule") or {}).get("enabled"):
            raise NotInDslaunchError("random_ltd.layer_token_lr_schedule: the layer-token LR schedule is not "
                                     "implemented (DeepSpeed's is unfinished too); set enabled to false")
        self.reset_to_init()

    def reset_to_init(self) -> None:
        schedule = self.config_schedule
        if schedule is not None:
            self.state.update(min_value=schedule["min_value"], max_value=schedule["max_value"],
                              current_value=schedule["min_value"], schedule_config=schedule["schedule_config"],
                              schedule_type=schedule["schedule_type"])
        self.state.update(consumed_layer_tokens=0, current_steps=-1)

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """The layer tokens of ``train_iters`` steps from here (moves the schedule along)."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state["consumed_layer_tokens"]

    def get_current_seq(self) -> int:
        return self.state["current_value"]

    def set_current_seq(self, seq_length: int) -> None:
        self.state["current_value"] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict[str, Any]:
        return self.state

    def set_state(self, state: dict[str, Any]) -> None:
        self.state = state

    def update_seq(self, global_steps: int) -> None:
        """Move to step ``global_steps`` (a new step counts its global batch's layer tokens once)."""
        if self.state["current_value"] < self.state["max_value"]:
            self.state["current_value"] = self.get_value(global_steps)
        if global_steps != self.state["current_steps"]:
            full_layers = self.model_layer_num - self.random_ltd_layer_num
            self.state["consumed_layer_tokens"] += self.global_batch_size * (
                self.state["current_value"] * self.random_ltd_layer_num + self.state["max_value"] * full_layers)
            self.state["current_steps"] = global_steps

    def state_dict(self) -> dict[str, Any]:
        return {key: self.state[key] for key in _SAVED}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.state.update({key: state_dict[key] for key in _SAVED})
