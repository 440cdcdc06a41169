"""The ds_config ``activation_checkpointing`` block: how ``deepspeed.checkpointing`` keeps and
recomputes activations (``runtime/activation_checkpointing/``).

``{"activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true}}``

DeepSpeed's keys and defaults, each validated; ``mode`` is dslaunch's own (``"full"``: recompute the
whole checkpointed function, DeepSpeed's behaviour; ``"selective"``: keep the outputs of matrix
multiplications from the forward and recompute only the rest, as Megatron's and torchtitan's
selective recomputation). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, integer
from dslaunch.runtime.config.sections import _opt, optional, parse_section

__all__ = ["ActivationCheckpointingConfig", "MODES", "parse_activation_checkpointing", "check_contiguous"]

MODES = ("full", "selective")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """``activation_checkpointing``: what a checkpointed function keeps for its backward, and where."""

    partition_activations: bool = _opt(False, boolean, "true to split saved inputs over the "
                                       "model-parallel group")
    contiguous_memory_optimization: bool = _opt(False, boolean, "true or false (needs "
                                                "partition_activations and number_checkpoints)")
    cpu_checkpointing: bool = _opt(False, boolean, "true to keep saved inputs in host memory")
    number_checkpoints: int | None = _opt(None, optional(integer(1)), "the number of checkpointed "
                                          "layers, e.g. 24, or null")
    synchronize_checkpoint_boundary: bool = _opt(False, boolean, "true to synchronize the device at "
                                                 "each checkpoint's start and end")
    profile: bool = _opt(False, boolean, "true to time checkpointed forwards and recomputes")
    mode: str = _opt("full", choice(*MODES), "\"full\" or \"selective\" (dslaunch: keep matmul outputs)")

    UNIMPLEMENTED = {}  # noqa: RUF012


def check_contiguous(contiguous: bool, partition: bool, number: int | None, key: str) -> None:
    """DeepSpeed's rule: contiguous buffers hold partitioned activations, one per checkpoint.

    Raises:
        ConfigError: naming ``key`` when ``contiguous`` lacks ``partition`` or ``number``.
    """
    if contiguous and not partition:
        raise ConfigError("needs partition_activations: true (the contiguous buffers hold partitioned "
                          "activations); set it, or set this to false", key=key)
    if contiguous and number is None:
        raise ConfigError("needs number_checkpoints (how many buffers to keep): set it, or set this to "
                          "false", key=key)


def parse_activation_checkpointing(raw: Any, prefix: str = "activation_checkpointing"
                                   ) -> ActivationCheckpointingConfig:
    """Parse and cross-check the block (``raw``: a dict or None).

    Raises:
        ConfigError: one line naming the key path.
    """
    cfg = parse_section(ActivationCheckpointingConfig, raw, prefix)
    check_contiguous(cfg.contiguous_memory_optimization, cfg.partition_activations, cfg.number_checkpoints,
                     f"{prefix}.contiguous_memory_optimization")
    return cfg
