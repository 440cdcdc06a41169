"""The registry is the only list of stages: strategies resolve, and the config reads its stages from it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import ZeroConfig, load_config
from dslaunch.runtime.zero.registry import STAGES, STRATEGIES, stage_choices, strategy_class


def test_every_stage_resolves_to_its_strategy() -> None:
    from dslaunch.runtime.zero.strategy import ZeroStrategy

    assert STAGES == tuple(STRATEGIES) == (0, 1, 2, 3)
    for stage in STAGES:
        cls = strategy_class(stage)
        assert issubclass(cls, ZeroStrategy) and cls.stage == stage
        assert cls.placement_type.partitioned == (stage > 0)


def test_stage_choices_reads_like_a_sentence() -> None:
    assert stage_choices() == "0, 1, 2 or 3"


def test_config_accepts_exactly_the_registered_stages() -> None:
    for stage in STAGES:
        assert load_config({"train_batch_size": 1, "zero_optimization": {"stage": stage}}, 1) \
            .zero_optimization.stage == stage
    with pytest.raises(ConfigError, match=r"zero_optimization.stage.*in \[0, 3\]"):
        load_config({"train_batch_size": 1, "zero_optimization": {"stage": 4}}, 1)
    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(ZeroConfig)}["stage"]
    assert help_text == f"the ZeRO stage: {stage_choices()}"


def test_the_registry_and_the_config_import_no_torch() -> None:
    code = ("import sys; import dslaunch.runtime.zero.registry, dslaunch.runtime.config; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
