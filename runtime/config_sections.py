"""The ds_config sections as typed, frozen dataclasses, and the one way a section is parsed.

Each field carries its checker and a short help text in its metadata; ``parse_section`` turns a
user dict into the dataclass: unknown keys -> ``ConfigError`` with did-you-mean, wrong types and
ranges name the key path (checkers from ``param_schema``), ``"auto"`` explains what to put there,
and keys DeepSpeed accepts that dslaunch does not implement are reported as such unless they hold
their inert value (e.g. ``"enabled": false``). Torch-free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError
from dslaunch.runtime.param_schema import Option, boolean, check_params, choice, integer, number

__all__ = ["parse_section", "ZeroConfig", "Fp16Config", "Bf16Config", "CheckpointConfig",
           "TypedSection", "optional", "INERT_SECTIONS", "reject_unimplemented"]


def optional(check: Any) -> Any:
    """A checker that also accepts null (None)."""
    return lambda path, value: None if value is None else check(path, value)


def _tag_validation(path: str, value: Any) -> str:
    # DeepSpeed compares case-insensitively; keep its capitalised spelling.
    valid = ("Ignore", "Warn", "Fail")
    if isinstance(value, str) and value.capitalize() in valid:
        return value.capitalize()
    return choice(*valid)(path, value)


def _opt(default: Any, check: Any, help: str) -> Any:
    return field(default=default, metadata={"check": check, "help": help})


@dataclass(frozen=True)
class ZeroConfig:
    """``zero_optimization``: which ZeRO stage and its communication knobs."""

    stage: int = _opt(0, integer(0), "the ZeRO stage: 0, 1 or 2")
    reduce_bucket_size: int = _opt(500_000_000, integer(1), "elements reduced per bucket, e.g. 5e8")
    allgather_bucket_size: int = _opt(500_000_000, integer(1), "elements gathered per bucket, e.g. 5e8")
    overlap_comm: bool = _opt(False, boolean, "true to overlap gradient reduction with backward")
    contiguous_gradients: bool = _opt(True, boolean, "true (dslaunch always copies gradients "
                                      "into contiguous buckets)")
    reduce_scatter: bool = _opt(True, boolean, "true or false")
    allgather_partitions: bool = _opt(True, boolean, "true or false")
    load_from_fp32_weights: bool = _opt(True, boolean, "true or false")
    elastic_checkpoint: bool = _opt(False, boolean, "true or false")
    ignore_unused_parameters: bool = _opt(True, boolean, "true or false")
    round_robin_gradients: bool = _opt(False, boolean, "true or false")
    use_multi_rank_bucket_allreduce: bool = _opt(True, boolean, "true or false")

    # DeepSpeed keys not implemented here -> the value that makes them inert.
    UNIMPLEMENTED = {"offload_optimizer": None, "offload_param": None, "cpu_offload": False,
                     "cpu_offload_params": False, "cpu_offload_use_pin_memory": False,
                     "zero_quantized_weights": False, "zero_quantized_gradients": False,
                     "zero_quantized_nontrainable_weights": False, "zero_hpz_partition_size": 1,
                     "mics_shard_size": -1, "mics_hierarchical_params_gather": False,
                     "legacy_stage1": False, "memory_efficient_linear": True}
    # Keys that only configure stage 3: meaningless (and so inert) at stages 0-2.
    STAGE3_ONLY = ("sub_group_size", "stage3_", "prefetch_bucket_size", "param_persistence_threshold",
                   "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
                   "gather_16bit_weights_on_model_save", "module_granularity_threshold",
                   "use_all_reduce_for_fetch_params", "zeropp_loco_param", "log_trace_cache_warnings",
                   "pipeline_loading_checkpoint", "override_module_apply")


@dataclass(frozen=True)
class Fp16Config:
    """``fp16``: fp16 model, fp32 master weights, loss scaling (dynamic unless loss_scale > 0)."""

    enabled: bool = _opt(False, boolean, "true or false")
    loss_scale: float = _opt(0.0, number(0.0), "0 for dynamic loss scaling, or a fixed scale > 0")
    initial_scale_power: int = _opt(16, integer(0), "an integer: the first dynamic scale is 2**power")
    loss_scale_window: int = _opt(1000, integer(1), "steps without overflow before the scale doubles")
    hysteresis: int = _opt(2, integer(1), "overflows tolerated before the scale halves")
    consecutive_hysteresis: bool = _opt(False, boolean, "true or false")
    min_loss_scale: float = _opt(1.0, number(0.0, low_open=True), "the smallest dynamic scale, e.g. 1")

    UNIMPLEMENTED = {"auto_cast": False, "fp16_master_weights_and_grads": False}


@dataclass(frozen=True)
class Bf16Config:
    """``bf16`` (alias ``bfloat16``): bf16 model with fp32 master weights, no loss scaling."""

    enabled: bool = _opt(False, boolean, "true or false")

    UNIMPLEMENTED = {"immediate_grad_update": False, "check_grad_overflow": False,
                     "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: how checkpoints are validated and written (read by the checkpoint code)."""

    tag_validation: str = _opt("Warn", _tag_validation, "Ignore, Warn or Fail")
    async_save: bool = _opt(False, boolean, "true to write checkpoints in the background")
    keep_last: int | None = _opt(None, optional(integer(1)), "how many checkpoints to keep, "
                                 "or null to keep all")
    use_node_local_storage: bool = _opt(False, boolean, "true if each node saves to local disk")

    UNIMPLEMENTED = {"load_universal": False, "parallel_write": None}


@dataclass(frozen=True)
class TypedSection:
    """``optimizer`` / ``scheduler``: a ``type`` name and its free-form ``params``."""

    type: str = _opt(None, optional(lambda p, v: v if isinstance(v, str) else _not_str(p, v)),
                     "a type name such as AdamW or WarmupLR")
    params: Mapping[str, Any] = _opt(None, optional(lambda p, v: v), "an object of parameters")

    UNIMPLEMENTED = {}  # noqa: RUF012


def _not_str(path: str, value: Any) -> str:
    raise ConfigError(f"must be a string, got {type(value).__name__} {value!r}", key=path)


# Top-level DeepSpeed sections dslaunch does not implement, accepted only while inert.
INERT_SECTIONS = ("amp", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb",
                  "csv_monitor", "comet", "comms_logger", "monitor_config", "pipeline", "elasticity",
                  "aio", "compression_training", "data_efficiency", "autotuning", "nebula",
                  "curriculum_learning", "eigenvalue", "progressive_layer_drop", "sparse_attention",
                  "hybrid_engine", "torch_autocast", "compile", "data_types", "weight_quantization",
                  "quantize_training", "checkpoint_tag", "dump_state", "memory_breakdown",
                  "sparse_gradients", "seq_parallel_size", "sequence_parallel_size",
                  "zero_force_ds_cpu_optimizer", "graph_harvesting", "use_data_before_expert_parallel",
                  "timers", "fp32_allreduce", "disable_allgather")


def _inert(value: Any, inert: Any = None) -> bool:
    """False/None/0/1-like values, empty dicts, and dicts whose flags are all off."""
    if value is None or value is False or value == inert:
        return True
    if isinstance(value, Mapping):
        return all(_inert(v) or k not in ("enabled", "partition_activations", "cpu_checkpointing",
                                          "deepcompile", "profile", "device")
                   or (k == "device" and v in (None, "none")) for k, v in value.items())
    return False


def reject_unimplemented(key: str, value: Any, inert: Any = None) -> None:
    """Raise unless ``value`` leaves the unimplemented DeepSpeed feature ``key`` switched off."""
    if not _inert(value, inert):
        off = '"enabled": false' if inert is None else f"{inert!r}"
        raise ConfigError(f"is accepted by DeepSpeed but not implemented by dslaunch yet; remove it "
                          f"(or switch it off: {off})", key=key)


def _explain_auto(cls: type, raw: Mapping[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        if value == "auto":
            f = fields.get(key)
            what = f.metadata["help"] if f is not None else "the actual value"
            default = f" (or remove the key for the default, {f.default!r})" if f is not None else ""
            raise ConfigError(f"'auto' is a Hugging Face Trainer placeholder that only the Trainer fills "
                              f"in; put {what} here{default}", key=f"{prefix}.{key}" if prefix else key)


def parse_section(cls: type, raw: Any, prefix: str) -> Any:
    """Parse ``raw`` (a dict or None) into the frozen dataclass ``cls``.

    Raises:
        ConfigError: naming ``<prefix>.<key>`` for unknown keys (did-you-mean), bad values,
            ``"auto"``, or non-inert keys DeepSpeed has but dslaunch does not implement.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be an object, got {type(raw).__name__} {raw!r}", key=prefix)
    _explain_auto(cls, raw, prefix)
    known: dict[str, Any] = {}
    for key, value in raw.items():
        if key in cls.UNIMPLEMENTED:
            reject_unimplemented(f"{prefix}.{key}", value, cls.UNIMPLEMENTED[key])
        elif not any(key.startswith(s) for s in getattr(cls, "STAGE3_ONLY", ())):
            known[key] = value
    schema = {f.name: Option(f.default, f.metadata["check"]) for f in dataclasses.fields(cls)}
    return cls(**check_params(known, schema, prefix, f"section '{prefix}'"))
