"""The ``activation_checkpointing`` block: DeepSpeed's keys and defaults, each validated, the
contiguous-buffer rule, and dslaunch's ``mode``."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config
from dslaunch.runtime.config.activation import ActivationCheckpointingConfig


def _load(block: object) -> ActivationCheckpointingConfig:
    return load_config({"train_batch_size": 2, "activation_checkpointing": block}, 1).activation_checkpointing


def test_defaults_are_deepspeeds() -> None:
    cfg = load_config({"train_batch_size": 2}, 1).activation_checkpointing
    assert cfg == ActivationCheckpointingConfig(False, False, False, None, False, False, "full")


def test_every_key_is_read() -> None:
    cfg = _load({"partition_activations": True, "contiguous_memory_optimization": True, "cpu_checkpointing": True,
                 "number_checkpoints": 12, "synchronize_checkpoint_boundary": True, "profile": True,
                 "mode": "selective"})
    assert cfg == ActivationCheckpointingConfig(True, True, True, 12, True, True, "selective")


@pytest.mark.parametrize("block, start", [
    ({"cpu_checkpointing": 2}, "'activation_checkpointing.cpu_checkpointing': must be true or false"),
    ({"number_checkpoints": 0}, "'activation_checkpointing.number_checkpoints': must be an integer"),
    ({"mode": "partial"}, "'activation_checkpointing.mode': must be one of"),
    ({"partition_activation": True}, "'activation_checkpointing.partition_activation': unknown parameter"),
    ({"contiguous_memory_optimization": True, "number_checkpoints": 2},
     "'activation_checkpointing.contiguous_memory_optimization': needs partition_activations: true"),
    ({"contiguous_memory_optimization": True, "partition_activations": True},
     "'activation_checkpointing.contiguous_memory_optimization': needs number_checkpoints"),
    ([], "'activation_checkpointing': must be an object"),
])
def test_bad_values_are_one_line_naming_the_key(block: object, start: str) -> None:
    with pytest.raises(ConfigError) as err:
        _load(block)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)


def test_a_typo_gets_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'partition_activations'"):
        _load({"partition_activation": True})
