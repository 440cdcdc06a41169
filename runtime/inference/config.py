"""The ``init_inference`` configuration: DeepSpeed's ``DeepSpeedInferenceConfig`` and its sections
as frozen dataclasses, parsed once from a dict (or keyword arguments) by ``parse_inference_config``.

Unknown keys are errors with a did-you-mean; keys DeepSpeed has that dslaunch does not implement
fail unless they are off (``runtime.config.sections.reject_unimplemented``); keys that are valid
but cannot apply on this device (CUDA graphs, kernel injection on CPU) are logged in one line each
by the engine (``device_notes``). Torch is imported only to name dtypes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.param_schema import boolean, choice, describe, integer
from dslaunch.runtime.config.sections import Off, optional, parse_section

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceCheckpointConfig", "QuantizationConfig",
           "WeightQuantConfig", "DeepSpeedMoEConfig", "parse_inference_config", "device_notes"]


def _opt(default: Any, check: Any, help: str) -> Any:
    return field(default=default, metadata={"check": check, "help": help})


def _anything(path: str, value: Any) -> Any:
    return value  # process groups and mpu objects: checked where they are used


_DTYPES = {"fp32": "float32", "float32": "float32", "float": "float32", "fp16": "float16", "float16": "float16",
           "half": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16", "int8": "int8"}


def _dtype(path: str, value: Any) -> Any:
    """A torch dtype from DeepSpeed's spellings (``torch.half``, ``"fp16"``, ``"bfloat16"``...);
    int8 means weight-only int8 quantization with fp32 compute."""
    import torch

    if isinstance(value, torch.dtype):
        value = str(value).removeprefix("torch.")
    if isinstance(value, str) and value.removeprefix("torch.").lower() in _DTYPES:
        return getattr(torch, _DTYPES[value.removeprefix("torch.").lower()])
    raise ConfigError(f"must be a dtype ({', '.join(sorted(_DTYPES))} or a torch dtype), got {describe(value)}",
                      key=path)


@dataclass(frozen=True)
class DeepSpeedTPConfig:
    """``tensor_parallel`` (alias ``tp``): how many ranks share each layer."""

    enabled: bool = _opt(True, boolean, "true")
    tp_size: int = _opt(1, integer(1, 1024), "the number of tensor-parallel ranks")
    tp_group: Any = _opt(None, _anything, "a process group of tp_size ranks (default: the world)")
    mpu: Any = _opt(None, _anything, "an object with get_model_parallel_group()")

    UNIMPLEMENTED = {"tp_grain_size": 1}  # noqa: RUF012


@dataclass(frozen=True)
class InferenceCheckpointConfig:
    """``checkpoint`` given as an object in DeepSpeed's checkpoint description format."""

    checkpoint_dir: str | None = _opt(None, optional(lambda p, v: str(v)), "a checkpoint directory")
    save_mp_checkpoint_path: str | None = _opt(None, optional(lambda p, v: str(v)), "null")
    base_dir: str | None = _opt(None, optional(lambda p, v: str(v)), "the directory the file names are in")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class WeightQuantConfig:
    """``quant.weight``: weight-only quantization, one scale per output row."""

    enabled: bool = _opt(True, boolean, "true or false")
    num_bits: int = _opt(8, lambda p, v: _bits(p, v), "8")
    q_groups: int = _opt(1, integer(1), "ignored: one group per output row")
    q_type: str = _opt("symmetric", choice("symmetric"), "symmetric")

    UNIMPLEMENTED = {}  # noqa: RUF012


def _bits(path: str, value: Any) -> int:
    if value != 8 or isinstance(value, bool):
        raise ConfigError(f"only 8-bit weights are implemented, got {describe(value)}", key=path)
    return 8


@dataclass(frozen=True)
class QuantizationConfig:
    """``quant``: dslaunch's weight-only int8 (dequantized to the compute dtype in each forward)."""

    enabled: bool = _opt(False, boolean, "true to store Linear weights as int8")
    weight: Any = _opt(None, optional(lambda p, v: parse_section(WeightQuantConfig, v, p)), "an object")

    UNIMPLEMENTED = {"activation": Off({"enabled": False}, switch="enabled"),  # noqa: RUF012
                     "qkv": Off({"enabled": True}, switch="enabled")}


@dataclass(frozen=True)
class DeepSpeedMoEConfig:
    """``moe``: accepted when off; expert parallelism is not implemented."""

    enabled: bool = _opt(False, lambda p, v: _off(p, v), "false")

    UNIMPLEMENTED = {"ep_size": 1, "moe_experts": (1, [1]), "type": "standard", "ep_group": None,  # noqa: RUF012
                     "ep_mp_group": None}


def _off(path: str, value: Any) -> bool:
    if boolean(path, value):
        raise ConfigError("mixture-of-experts inference is not implemented by dslaunch yet; set it to false "
                          "(a MoE model still runs, its experts sharded like any Linear)", key=path)
    return False


def _section(cls: type) -> Any:
    return lambda path, value: value if isinstance(value, cls) else parse_section(cls, value, path)


def _checkpoint(path: str, value: Any) -> Any:
    if isinstance(value, (str, Mapping)) or hasattr(value, "__fspath__"):
        return dict(value) if isinstance(value, Mapping) else str(value)
    raise ConfigError(f"must be a path (checkpoint description JSON, checkpoint directory or weights file) or "
                      f"a checkpoint description object, got {describe(value)}", key=path)


def _policy(path: str, value: Any) -> Any:
    if isinstance(value, Mapping):
        return dict(value)
    raise ConfigError("must map a block class to the names of its row-parallel Linears, e.g. "
                      "{LlamaDecoderLayer: ('self_attn.o_proj', 'mlp.down_proj')}", key=path)


@dataclass(frozen=True)
class DeepSpeedInferenceConfig:
    """What ``init_inference`` reads. DeepSpeed's keys and defaults, except ``dtype`` (default: the
    model's own; DeepSpeed's is fp16, which CPUs run slowly) and dslaunch's ``tp_allreduce``."""

    dtype: Any = _opt(None, optional(_dtype), "fp32, fp16, bf16 or int8")
    tensor_parallel: DeepSpeedTPConfig = _opt(DeepSpeedTPConfig(), _section(DeepSpeedTPConfig), "an object")
    checkpoint: Any = _opt(None, optional(_checkpoint), "a path or a checkpoint description")
    base_dir: str | None = _opt(None, optional(lambda p, v: str(v)), "the directory checkpoint files are in")
    replace_with_kernel_inject: bool = _opt(False, boolean, "true to use the fused kernels on CUDA")
    injection_policy: Any = _opt(None, optional(_policy), "{block class: row-parallel Linear names}")
    quant: QuantizationConfig = _opt(QuantizationConfig(), _section(QuantizationConfig), "an object")
    moe: Any = _opt(False, lambda p, v: v if isinstance(v, bool) and not v else _section(DeepSpeedMoEConfig)(p, v),
                    "false")
    enable_cuda_graph: bool = _opt(False, boolean, "true or false (CUDA only)")
    max_out_tokens: int = _opt(1024, integer(1), "the longest sequence (kernel workspace sizing)")
    min_out_tokens: int = _opt(1, integer(1), "a positive integer")
    keep_module_on_host: bool = _opt(False, boolean, "true or false")
    replace_method: str = _opt("auto", choice("auto"), "auto")
    return_tuple: bool = _opt(True, boolean, "true")
    triangular_masking: bool = _opt(True, boolean, "true")
    tp_allreduce: str = _opt("auto", choice("auto", "shm", "torch"),
                             "auto (shared memory when every tensor-parallel rank is on this host), shm or torch")

    AUTO_OK = ("replace_method", "tp_allreduce")  # "auto" is their default here, not the Trainer's placeholder
    UNIMPLEMENTED = {"zero": Off({"stage": 0}, switch="stage"), "use_triton": False,  # noqa: RUF012
                     "triton_autotune": False, "save_mp_checkpoint_path": None, "checkpoint_config": None,
                     "set_empty_params": False, "transposed_mode": False, "ep_size": 1, "moe_experts": (1, [1]),
                     "moe_type": "standard", "ep_group": None, "ep_mp_group": None, "training_mp_size": 1,
                     "injection_policy_tuple": None, "use_cuda_events": False, "config": None}


# DeepSpeed's other spellings of a key -> the key.
_ALIASES = {"tp": "tensor_parallel", "kernel_inject": "replace_with_kernel_inject", "checkpoint_json": "checkpoint",
            "max_tokens": "max_out_tokens", "min_tokens": "min_out_tokens", "args": None}


def _merge(config: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """One dict from ``config`` (dict, ``DeepSpeedInferenceConfig`` or None) and keyword arguments;
    a key set both ways to different values is an error (as DeepSpeed's assert, in one line)."""
    if isinstance(config, DeepSpeedInferenceConfig):
        base = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    elif config is None:
        base = {}
    elif isinstance(config, Mapping):
        base = dict(config)
    else:
        raise ConfigError(f"must be a dict or a DeepSpeedInferenceConfig, got {describe(config)}", key="config")
    for key, value in kwargs.items():
        if key in base and base[key] != value and not isinstance(config, DeepSpeedInferenceConfig):
            raise ConfigError(f"given both in config ({base[key]!r}) and as a keyword argument ({value!r}); give "
                              "it once", key=key)
        base[key] = value
    return base


def _legacy_tp(raw: dict[str, Any]) -> None:
    """``mp_size`` and a top-level ``mpu`` are DeepSpeed's deprecated spellings of tensor_parallel keys."""
    moved = {"mp_size": "tp_size", "mpu": "mpu"}
    for old, new in moved.items():
        if old not in raw:
            continue
        value = raw.pop(old)
        tp = raw.get("tensor_parallel")
        tp = {f.name: getattr(tp, f.name) for f in dataclasses.fields(tp)} if isinstance(tp, DeepSpeedTPConfig) \
            else dict(tp or {})
        if new in tp and tp[new] not in (value, DeepSpeedTPConfig.__dataclass_fields__[new].default):
            raise ConfigError(f"'{old}' (deprecated) and 'tensor_parallel.{new}' disagree; keep "
                              f"'tensor_parallel.{new}'", key=old)
        tp[new] = value
        raw["tensor_parallel"] = tp


def parse_inference_config(config: Any = None, **kwargs: Any) -> DeepSpeedInferenceConfig:
    """Parse ``init_inference``'s ``config`` and keyword arguments into a ``DeepSpeedInferenceConfig``.

    Raises:
        ConfigError: one line naming the key and what is valid.
    """
    raw = _merge(config, kwargs)
    for alias, key in _ALIASES.items():
        if alias in raw:
            value = raw.pop(alias)
            if key is not None:
                if key in raw:
                    raise ConfigError(f"sets the same thing as '{key}'; keep one", key=alias)
                raw[key] = value
    _legacy_tp(raw)
    return parse_section(DeepSpeedInferenceConfig, raw, "init_inference")


def device_notes(config: DeepSpeedInferenceConfig, on_cuda: bool) -> list[str]:
    """One line per key that is valid but changes nothing on this device (logged, never silent)."""
    notes = []
    if config.enable_cuda_graph:
        notes.append("enable_cuda_graph: " + ("not implemented by dslaunch yet; running eagerly" if on_cuda
                                              else "CUDA graphs need a CUDA device; running eagerly on CPU"))
    if config.replace_with_kernel_inject and not on_cuda:
        notes.append("replace_with_kernel_inject: the fused kernels run on CUDA only; on CPU the modules stay "
                     "torch's (a no-op)")
    if config.keep_module_on_host and not on_cuda:
        notes.append("keep_module_on_host: the module already lives on the host (CPU); nothing to keep")
    if config.max_out_tokens != 1024 and not config.replace_with_kernel_inject:
        notes.append("max_out_tokens: sizes the injected kernels' workspace; without kernel injection it "
                     "changes nothing")
    return notes
