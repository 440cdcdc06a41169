"""The config objects as DeepSpeed's classes are called: ``DeepSpeedConfig(dict_or_path, mpu)``,
``DeepSpeedZeroConfig(**section)`` and its offload sections, DeepSpeed's deprecated switches."""

from __future__ import annotations

import json
import pickle
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from dslaunch.errors import ConfigError
from dslaunch.runtime.config import DeepSpeedConfig, load_config
from dslaunch.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config, get_bfloat16_config
from dslaunch.runtime.zero.config import (
    DeepSpeedZeroConfig,
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)


class _Mpu:
    def get_data_parallel_world_size(self) -> int:
        return 4


def test_deepspeed_config_parses_a_dict_a_path_and_an_mpu_world(tmp_path: Path) -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 8})
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.world_size) == (8, 8, 1)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    assert DeepSpeedConfig(str(path), mpu=_Mpu()).train_micro_batch_size_per_gpu == 2
    assert DeepSpeedConfig(config={"train_batch_size": 8}, mpu=_Mpu()).world_size == 4
    with pytest.raises(ConfigError, match="unknown key"):
        DeepSpeedConfig({"train_batch_size": 8, "train_bach_size": 8})
    # the dataclass's own constructor (and dataclasses.replace) still work field by field
    assert DeepSpeedConfig(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1,
                           world_size=1).train_batch_size == 2


def test_cpu_offload_switches_are_the_offload_sections() -> None:
    zero = load_config({"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True, "cpu_offload_use_pin_memory": False}},
        1).zero_optimization
    assert zero.offload_optimizer.device == zero.offload_param.device == "cpu"
    assert not zero.offload_optimizer.pin_memory
    off = load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": False}},
                      1).zero_optimization
    assert not off.offload_optimizer.enabled
    with pytest.raises(ConfigError, match="sets the same thing as 'zero_optimization.offload_optimizer'"):
        load_config({"train_batch_size": 8, "zero_optimization": {
            "stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}}, 1)
    with pytest.raises(ConfigError, match="cpu_offload"):
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 2, "cpu_offload": "yes"}}, 1)


def test_zero_config_as_deepspeeds_class() -> None:
    zero = DeepSpeedZeroConfig(stage3_prefetch_bucket_size=12345, param_persistence_threshold=7,
                               stage3_gather_fp16_weights_on_model_save=True)
    assert isinstance(zero, DeepSpeedZeroConfig)
    assert (zero.prefetch_bucket_size, zero.param_persistence_threshold, zero.gather_16bit_weights_on_model_save) \
        == (12345, 7, True)
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert not DeepSpeedZeroConfig(stage=1).pipeline_loading_checkpoint
    assert isinstance(DeepSpeedZeroConfig(stage=3, cpu_offload_param=True).offload_param,
                      DeepSpeedZeroOffloadParamConfig)
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline
    with pytest.raises(ConfigError, match="did you mean"):
        DeepSpeedZeroConfig(stag=3)


def test_bfloat16_block_under_either_name() -> None:
    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled
    assert not get_bfloat16_config({}).enabled
    with pytest.raises(ConfigError, match="not both"):
        get_bfloat16_config({"bf16": {}, "bfloat16": {}})


def test_precision_config_classes_parse_as_the_config_file_does() -> None:
    fp16 = DeepSpeedFP16Config(enabled=True, loss_scale=0, loss_scale_window=2, min_loss_scale=4)
    assert isinstance(fp16, DeepSpeedFP16Config) and (fp16.loss_scale_window, fp16.min_loss_scale) == (2, 4)
    assert DeepSpeedFP16Config(enabled=True, loss_scale=128, min_loss_scale=0).loss_scale == 128  # static
    assert DeepSpeedBF16Config(enabled=True).enabled and not isinstance(fp16, DeepSpeedBF16Config)
    for bad, key in (({"loss_scale": -1}, "loss_scale"), ({"loss_scale": True}, "loss_scale"),
                     ({"loss_scale": []}, "loss_scale"), ({"min_loss_scale": 0}, "min_loss_scale"),
                     ({"loss_scale_window": float("inf")}, "loss_scale_window"),
                     ({"loss_scale_window": True}, "loss_scale_window")):
        with pytest.raises(ConfigError, match=rf"^'fp16\.{key}': must be"):  # a ValueError, one line
            DeepSpeedFP16Config(enabled=True, **bad)


def test_deepspeed_named_sections_raise_pydantics_validation_error() -> None:
    pytest.importorskip("pydantic", reason="the class is pydantic's, which dslaunch does not require")
    from pydantic import ValidationError

    for bad, key in (({"loss_scale": float("nan")}, "loss_scale"), ({"loss_scale": {}}, "loss_scale"),
                     ({"min_loss_scale": False}, "min_loss_scale"), ({"loss_scale_window": -1}, "loss_scale_window"),
                     ({"loss_scale_windw": 2}, "loss_scale_windw")):
        with pytest.raises(ValidationError) as caught:  # DeepSpeed's models are pydantic's
            DeepSpeedFP16Config(enabled=True, loss_scale=bad.pop("loss_scale", 0), **bad)
        err = caught.value
        # still dslaunch's one line naming the key, and pydantic's error list
        assert isinstance(err, ConfigError) and err.key == f"fp16.{key}"
        assert str(err).startswith(f"'fp16.{key}': ") and "\n" not in str(err)
        assert [e["loc"] for e in err.errors()] == [(key,)]
        again = pickle.loads(pickle.dumps(err))  # as a rank's error reaches its parent
        assert isinstance(again, ValidationError) and (str(again), again.key) == (str(err), err.key)
    with pytest.raises(ValidationError, match="did you mean"):
        DeepSpeedZeroConfig(stag=3)
    # the config file's own parse keeps the plain ConfigError
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "fp16": {"loss_scale": -1}}, 1)
    assert not isinstance(caught.value, ValidationError)


def test_config_model_base_class_as_deepspeeds() -> None:
    pytest.importorskip("pydantic", reason="DeepSpeedConfigModel needs pydantic, which dslaunch does not require")
    from pydantic import Field, ValidationError

    from dslaunch.runtime.config_utils import DeepSpeedConfigModel

    class Section(DeepSpeedConfigModel):
        size: int = 0
        old_names: str | None = Field(None, json_schema_extra={"deprecated": True, "new_param": "names",
                                                                "new_param_fn": lambda v: [v]})
        names: list[str] | None = None
        rate: float = Field(1.0, alias="rate_alias")

    assert Section(old_names="a").names == ["a"]
    assert Section(rate_alias=2.0).rate == Section(rate=2.0).rate == 2.0
    assert Section(size="auto").size == 0  # "auto" keeps the default
    for bad in ({"size": "x"}, {"sise": 1}):
        with pytest.raises(ValidationError):
            Section(**bad)
    with pytest.raises(AssertionError, match="not both"):
        Section(old_names="a", names=["b"])


def test_deepspeed_form_config_re_resolves_assigned_batch_sizes() -> None:
    cfg = DeepSpeedConfig({"train_batch_size": 8}, mpu=_Mpu())
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = None, 3, 2
    cfg._configure_train_batch_size()
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (24, 3, 2)
    # DeepSpeed's check is an assertion: both its type and ours (a ValueError naming the arithmetic)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu = 30, None
    with pytest.raises(AssertionError, match="not divisible by gradient_accumulation_steps"):
        cfg._configure_train_batch_size()
    cfg.train_batch_size = 0
    with pytest.raises(AssertionError, match="'train_batch_size': must be an integer in \\[1, "):
        cfg._configure_train_batch_size()
    with pytest.raises(AssertionError, match="24 != .* = 2 \\* 2 \\* 4 = 16"):
        DeepSpeedConfig({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 2,
                         "gradient_accumulation_steps": 2}, mpu=_Mpu())
    with pytest.raises(FrozenInstanceError):
        cfg.steps_per_print = 1  # only the batch sizes are DeepSpeed's mutable ones
    assert not hasattr(load_config({"train_batch_size": 8}, 1), "_configure_train_batch_size")
