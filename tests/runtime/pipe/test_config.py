"""The ``pipeline`` block: DeepSpeed's keys accepted and checked, ``schedule`` from the registry."""

from __future__ import annotations

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import load_config


def _pipeline(block: dict):
    return load_config({"train_batch_size": 8, "pipeline": block}, 1).pipeline


def test_deepspeeds_keys_and_the_schedule_are_accepted() -> None:
    cfg = _pipeline({"stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 2,
                     "pipe_partitioned": True, "grad_partitioned": False, "schedule": "1f1b"})
    assert (cfg.stages, cfg.activation_checkpoint_interval, cfg.schedule) == ("auto", 2, "1f1b")
    assert _pipeline({"stages": 4}).stages == 4
    assert load_config({"train_batch_size": 8}, 1).pipeline.schedule == "1f1b"


@pytest.mark.parametrize("block, start", [
    ({"stages": 0}, "'pipeline.stages': must be an integer in [1,"),
    ({"schedule": "gpipe"}, "'pipeline.schedule': must be one of 1f1b, interleaved, got 'gpipe'"),
    ({"activation_checkpoint_intervals": 1},
     "'pipeline.activation_checkpoint_intervals': unknown parameter for section 'pipeline' (did you mean "
     "'activation_checkpoint_interval'"),
    ({"seed_layers": "yes"}, "'pipeline.seed_layers': must be true or false"),
    ({"partition": 3}, "'pipeline.partition': must be a partition method"),
])
def test_bad_values_name_the_key(block: dict, start: str) -> None:
    with pytest.raises(ConfigError) as err:
        _pipeline(block)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)
