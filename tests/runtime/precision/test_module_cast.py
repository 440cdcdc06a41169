"""A 16-bit model's parameters are cast, its floating buffers keep their dtype (DeepSpeed 0.19.8's
cast: an fp32 rotary ``inv_freq`` or normalization statistics stay fp32), at every ZeRO stage."""

from __future__ import annotations

import pytest
import torch

import dslaunch
from tests.distributed import one_rank


class _Rotary(torch.nn.Module):
    """A linear layer with an fp32 buffer used in fp32 and cast back, as Hugging Face's rotary
    embeddings use ``inv_freq``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, dtype=torch.float32) / 8)))
        self.register_buffer("position", torch.arange(8))  # not floating: never cast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angle = (self.position[:, None].float() * self.inv_freq[None, :]).sum(0)
        return self.proj(x * angle.cos().to(x.dtype)).float().pow(2).mean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@one_rank
def test_parameters_are_cast_and_buffers_are_kept(stage: int, precision: str) -> None:
    torch.manual_seed(0)
    model = _Rotary()
    inv_freq = model.inv_freq.clone()
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000, precision: {"enabled": True},
        "zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    want = torch.bfloat16 if precision == "bf16" else torch.float16
    assert {p.dtype for p in engine.module.parameters()} == {want}
    assert engine.module.inv_freq.dtype == torch.float32 and torch.equal(engine.module.inv_freq, inv_freq)
    assert engine.module.position.dtype == torch.int64
    engine.backward(engine(torch.randn(2, 8, dtype=want)))
    engine.step()
    assert engine.module.inv_freq.dtype == torch.float32


class _Declares(torch.nn.Module):
    """A Hugging Face-style model declaring a submodule to keep in fp32, whose buffer arrives in bf16."""

    _keep_in_fp32_modules_strict = ["norm"]

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.Module()
        self.norm.register_buffer("scale", torch.ones(4, dtype=torch.bfloat16))
        self.register_buffer("other", torch.ones(4))


@pytest.mark.timeout(30)
def test_buffer_dtype_and_keep_in_fp32_patterns() -> None:
    from dslaunch.runtime.precision import PrecisionPolicy

    bf16 = PrecisionPolicy(torch.bfloat16, None)
    model = bf16.cast_module(_Declares())  # "auto": the declared modules' buffers come up to fp32
    assert model.norm.scale.dtype == torch.float32 and model.other.dtype == torch.float32
    model = bf16.cast_module(_Declares(), buffer_dtype=torch.bfloat16)  # the rest follows buffer_dtype
    assert model.norm.scale.dtype == torch.float32 and model.other.dtype == torch.bfloat16
    model = bf16.cast_module(_Declares(), buffer_dtype=torch.bfloat16, keep_in_fp32=["oth*"])
    assert model.norm.scale.dtype == torch.bfloat16 and model.other.dtype == torch.float32
    fp32 = PrecisionPolicy(torch.float32, None).cast_module(_Declares())  # fp32 training keeps nothing special
    assert fp32.norm.scale.dtype == torch.bfloat16


@pytest.mark.timeout(30)
def test_deepspeeds_keep_in_fp32_module_answers_the_same_patterns() -> None:
    from dslaunch.runtime import keep_in_fp32 as ds  # deepspeed.runtime.keep_in_fp32

    model = _Declares()
    pattern = ds.keep_in_fp32_pattern(model, ds.KEEP_IN_FP32_AUTO, torch.bfloat16)
    assert [b is model.norm.scale for b in ds.buffers_to_keep_in_fp32(model, pattern)] == [True]
    assert ds.keep_buffers_in_fp32(model, pattern) == 1 and model.norm.scale.dtype == torch.float32
    assert ds.keep_buffers_in_fp32(model, pattern) == 0  # already fp32
    assert ds.keep_in_fp32_pattern(model, [], torch.bfloat16) is None
    assert ds.keep_in_fp32_pattern(model, ["oth*"], torch.float32) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 3])
@one_rank
def test_data_types_buffer_dtype_and_keep_in_fp32_from_the_config(stage: int) -> None:
    torch.manual_seed(0)
    engine, *_ = dslaunch.initialize(model=_Rotary(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000, "bf16": {"enabled": True},
        "data_types": {"buffer_dtype": "bf16", "param_dtype": "bfloat16"}, "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert engine.module.inv_freq.dtype == torch.bfloat16  # opted in: DeepSpeed's older blanket cast
    assert engine._config.buffer_dtype == "bf16" and engine._config.param_dtype == "bf16"
    kept, *_ = dslaunch.initialize(model=_Rotary(), config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10_000, "bf16": {"enabled": True},
        "data_types": {"buffer_dtype": "bf16", "keep_in_fp32_modules": ["inv_freq"]},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    assert kept.module.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("data_types, message", [
    ({"param_dtype": "fp16"}, "'data_types.param_dtype': \"fp16\" conflicts with the model dtype the fp16/bf16 "
                              "blocks give (bf16)"),
    ({"buffer_dtype": "half-ish"}, "'data_types.buffer_dtype': must be \"fp32\", \"fp16\" or \"bf16\""),
    ({"keep_in_fp32_modules": "norm"}, "'data_types.keep_in_fp32_modules': must be a list of module name patterns"),
])
def test_data_types_refusals_are_one_line(data_types: dict, message: str) -> None:
    from dslaunch.errors import ConfigError
    from dslaunch.runtime.config import load_config

    with pytest.raises(ConfigError) as err:
        load_config({"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "data_types": data_types}, 1)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
