"""``init_inference``'s config: DeepSpeed's keys and spellings, one-line errors, device notes."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import ConfigError
from dslaunch.runtime.inference.config import DeepSpeedInferenceConfig, device_notes, parse_inference_config


def test_deepspeed_spellings_parse_to_one_config() -> None:
    config = parse_inference_config({"dtype": "fp16", "mp_size": 2, "replace_with_kernel_inject": False},
                                    max_tokens=64)
    assert config.dtype is torch.float16
    assert config.tensor_parallel.tp_size == 2  # mp_size is the deprecated alias
    assert config.max_out_tokens == 64
    assert parse_inference_config(tp={"tp_size": 4}, dtype=torch.bfloat16).tensor_parallel.tp_size == 4
    again = parse_inference_config(config)  # a DeepSpeedInferenceConfig is accepted as it is
    assert isinstance(again, DeepSpeedInferenceConfig) and again.tensor_parallel.tp_size == 2


@pytest.mark.parametrize(("config", "kwargs", "names"), [
    ({"tensor_paralel": {"tp_size": 2}}, {}, ["init_inference.tensor_paralel", "tensor_parallel"]),
    ({"tensor_parallel": {"tp_size": 0}}, {}, ["init_inference.tensor_parallel.tp_size"]),
    ({"dtype": "fp8"}, {}, ["init_inference.dtype", "bf16"]),
    ({"zero": {"stage": 3}}, {}, ["init_inference.zero.stage", "not implemented"]),
    ({"quant": {"enabled": True, "weight": {"num_bits": 4}}}, {}, ["quant.weight.num_bits", "8-bit"]),
    ({"mp_size": 2}, {"mp_size": 4}, ["mp_size", "once"]),
    ({"mp_size": 2, "tensor_parallel": {"tp_size": 4}}, {}, ["mp_size", "tensor_parallel.tp_size"]),
    ({"moe": {"enabled": True}}, {}, ["moe.enabled", "not implemented"]),
])
def test_bad_keys_are_one_line_naming_the_key(config: dict, kwargs: dict, names: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_inference_config(config, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    for name in names:
        assert name in message, message


def test_keys_that_cannot_apply_on_cpu_are_each_one_note() -> None:
    config = parse_inference_config(enable_cuda_graph=True, replace_with_kernel_inject=True,
                                    keep_module_on_host=True)
    notes = device_notes(config, on_cuda=False)
    assert [n.split(":")[0] for n in notes] == ["enable_cuda_graph", "replace_with_kernel_inject",
                                                 "keep_module_on_host"]
    assert device_notes(config, on_cuda=True) == ["enable_cuda_graph: not implemented by dslaunch yet; running eagerly"]
    assert device_notes(parse_inference_config(), on_cuda=False) == []
