"""The one way a ds_config section is parsed, and the small sections (fp16, bf16, checkpoint,
optimizer/scheduler); the bigger ones have their own modules (``zero``, ``pipeline``, ...).

Each field carries its checker and a short help text in its metadata; ``parse_section`` turns a
user dict into the dataclass: unknown keys -> ``ConfigError`` with did-you-mean, wrong types and
ranges name the key path (checkers from ``param_schema``), ``"auto"`` explains what to put there.

Keys DeepSpeed accepts that dslaunch does not implement are never silently ignored: each has an
``Off`` description of when it is switched off (its documented off/default values, or an
``enabled``-like switch set to off), and anything else is reported as "not implemented yet"
naming the first key path that is on (``reject_unimplemented``). Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError, DtypeMixError, did_you_mean
from dslaunch.runtime.config.param_schema import (
    INT_MAX,
    Option,
    boolean,
    check_params,
    choice,
    describe,
    integer,
    number,
)

__all__ = ["parse_section", "SectionClass", "Fp16Config", "Bf16Config", "DataTypesConfig", "CheckpointConfig", "TypedSection",
           "OptimizerSection", "optional", "Off", "ANY", "UNIMPLEMENTED_KEYS", "reject_unimplemented", "DTYPE_SPELLINGS"]


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


def _only(honoured: bool, instead: str) -> Any:
    """A boolean dslaunch honours with one value only; the other says what dslaunch does instead."""

    def check(path: str, value: Any) -> bool:
        if boolean(path, value) != honoured:
            raise ConfigError(f"{_json(value)} is not implemented by dslaunch yet: {instead}; remove the "
                              f"key or set it to {_json(honoured)}", key=path)
        return honoured

    return check


# ---- keys DeepSpeed has and dslaunch does not implement -------------------------------------------
@dataclass(frozen=True)
class Off:
    """When an unimplemented DeepSpeed feature (a section of keys) counts as switched off.

    ``values`` maps each known key to its off value: a value, a tuple of accepted values, a
    nested ``Off``, or ``ANY``. ``switch`` names a key (e.g. ``enabled``) whose off value turns
    the whole feature off, whatever else the section holds. Without the switch every key given
    must be known and hold its off value: a dict is not "off" just because it has no flag.
    """

    values: Mapping[str, Any] = field(default_factory=dict)
    switch: str | None = None


# Any value: the key only tunes a feature that is itself rejected unless off (e.g. NVMe offload).
ANY: Any = object()
_REMOVE: Any = object()  # marks "no off value to suggest: remove the key"
_UNLISTED: Any = object()  # marks a key this module does not know in that section


def _json(value: Any) -> str:
    return json.dumps(value)


def _same(value: Any, off: Any) -> bool:
    # True == 1 in Python; a boolean switch must not be satisfied by 1 or 0.
    return isinstance(value, bool) == isinstance(off, bool) and value == off


def _first_on(value: Any, spec: Any, path: str) -> tuple[str, Any, str] | None:
    """``(key path, its off value, hint)`` of the first part of ``value`` that is on; None if off."""
    if value is None or spec is ANY:  # null is how DeepSpeed spells "not configured"
        return None
    if not isinstance(spec, Off):
        offs = spec if isinstance(spec, tuple) else (spec,)
        return None if any(_same(value, o) for o in offs) else (path, offs[0], "")
    if not isinstance(value, Mapping):
        return path, _REMOVE, ""
    if spec.switch is not None and spec.switch in value:
        return _first_on(value[spec.switch], spec.values[spec.switch], f"{path}.{spec.switch}")
    for key, sub in value.items():
        if key not in spec.values:
            return f"{path}.{key}", _UNLISTED, did_you_mean(str(key), spec.values)
        found = _first_on(sub, spec.values[key], f"{path}.{key}")
        if found is not None:
            return found
    return None


def reject_unimplemented(key: str, value: Any, spec: Any) -> None:
    """Raise unless ``value`` leaves the unimplemented DeepSpeed feature ``key`` switched off.

    Raises:
        ConfigError: naming the first key path that is on and how to switch it off.
    """
    found = _first_on(value, spec, key)
    if found is None:
        return
    path, off, hint = found
    what = "is accepted by DeepSpeed but not implemented by dslaunch yet"
    removed = REMOVED_FROM_DEEPSPEED.get(key.rpartition(".")[2])  # a section's key too (zero_optimization.*)
    if removed is not None:
        what = f"was removed from DeepSpeed in 0.19.8 ({removed}) and dslaunch does not have it"
    if off is _UNLISTED:
        parent = path.rpartition(".")[0]
        what = f"is not a known key of '{parent}'{hint}, which dslaunch does not implement yet"
    if off is _REMOVE or off is _UNLISTED:
        fix = "remove it" if path == key else f"remove it (or remove '{key}')"
    elif path == key:
        fix = f"remove it (or set it to {_json(off)})"
    else:
        fix = f"set it to {_json(off)} (or remove '{key}')"
    raise ConfigError(f"{what}; {fix}", key=path)


# Features DeepSpeed 0.19.8 removed (its runtime/config.py refuses them) that dslaunch never had:
# a script written for an older DeepSpeed learns that the feature is gone, not that it is to come.
REMOVED_FROM_DEEPSPEED: dict[str, str] = {
    "sparse_gradients": "sparse exchange of dense embedding gradients; an nn.Embedding(sparse=True) "
                        "trains without the key",
    "nebula": "checkpoints go through the usual checkpoint engine",
    "amp": "NVIDIA Apex AMP; use fp16, bf16 or torch_autocast",
    "quantize_training": "Mixture-of-Quantization",
    "eigenvalue": "eigenvalue-based Mixture-of-Quantization",
    "graph_harvesting": "graph harvesting",
    "mics_shard_size": "MiCS ZeRO-3 sharding within groups; ZeRO-3 with zero_hpz_partition_size keeps "
                       "a node-local secondary shard for the gathers",
    "mics_hierarchical_params_gather": "MiCS ZeRO-3 sharding within groups",
    "zeropp_loco_param": "LoCo error feedback for ZeRO++ quantized gradients; zero_quantized_gradients "
                         "works without it",
}


def _enabled() -> Off:
    """A feature switched by ``enabled`` (off: false); its other keys only matter when it is on."""
    return Off({"enabled": False}, switch="enabled")


# ---- the sections -------------------------------------------------------------------------------
# A scale of 2**64 already overflows any fp16 gradient (max 65504); more only skips more steps
# before the dynamic scaler gets down to a usable scale (and 2**128 is inf in fp32).
MAX_SCALE_POWER = 64
MAX_LOSS_SCALE = 2.0**MAX_SCALE_POWER


@dataclass(frozen=True)
class Fp16Config:
    """``fp16``: fp16 model, fp32 master weights, loss scaling (dynamic unless loss_scale > 0)."""

    enabled: bool = _opt(False, boolean, "true or false")
    loss_scale: float = _opt(0.0, number(0.0, MAX_LOSS_SCALE), "0 for dynamic loss scaling, or a fixed scale > 0")
    initial_scale_power: int = _opt(16, integer(0, MAX_SCALE_POWER),
                                    "an integer: the first dynamic scale is 2**power")
    # The window and the floor only act under dynamic scaling; elsewhere DeepSpeed keeps any value
    # given (a static-scale config may carry 0), so their ranges are checked in __post_init__.
    loss_scale_window: int = _opt(1000, integer(-INT_MAX), "steps without overflow before the scale doubles")
    hysteresis: int = _opt(2, integer(1), "overflows tolerated before the scale halves")
    consecutive_hysteresis: bool = _opt(False, boolean, "true or false")
    min_loss_scale: float = _opt(1.0, number(high=MAX_LOSS_SCALE), "the smallest dynamic scale, e.g. 1")

    auto_cast: bool = _opt(False, boolean, "true to cast the forward's floating-point positional inputs to fp16")

    UNIMPLEMENTED = {"fp16_master_weights_and_grads": False}

    def __post_init__(self) -> None:
        if not (self.enabled and self.loss_scale == 0):
            return
        why = "when dynamic loss scaling is on (fp16.enabled true, fp16.loss_scale 0)"
        if self.loss_scale_window < 1:  # the scaler doubles every window steps: 0 divides by zero
            raise ConfigError(f"must be an integer >= 1 {why}, got {self.loss_scale_window}",
                              key="fp16.loss_scale_window")
        if self.min_loss_scale <= 0:  # the floor of the scale: <= 0 lets it fall to nothing
            raise ConfigError(f"must be > 0 {why}, got {self.min_loss_scale:g}", key="fp16.min_loss_scale")


@dataclass(frozen=True)
class Bf16Config:
    """``bf16`` (alias ``bfloat16``): bf16 model with fp32 master weights, no loss scaling."""

    enabled: bool = _opt(False, boolean, "true or false")
    check_grad_overflow: bool = _opt(True, boolean, "true to skip a step whose gradients hold inf/NaN")
    """As DeepSpeed's (default true): a step whose global gradient norm is not finite is skipped
    and counted in ``skipped_steps`` (bf16 has no loss scale to lower)."""

    immediate_grad_update: bool = _opt(False, boolean, "true to add each bf16 gradient to the fp32 accumulator "
                                       "in its backward hook and free it (with data_types.grad_accum_dtype fp32)")
    """With ``data_types.grad_accum_dtype: "fp32"`` at ZeRO 0/1: true adds each bf16 gradient to the
    fp32 accumulator as backward produces it and frees it; false (DeepSpeed 0.19.8's default) adds
    them all after backward. The same numbers; true holds less memory. Elsewhere nothing changes:
    no 16-bit gradient outlives its hook there."""

    UNIMPLEMENTED = {"bf16_master_weights_and_grads": False, "bf16_optimizer_states": False}
    # fp16's loss-scaling keys, checked as in fp16 and then ignored: bf16 needs no loss scaling.
    # DeepSpeed's CIFAR example writes them into bf16 (DeepSpeed 0.19.8 itself rejects them there).
    INERT = {f.name: f.metadata["check"] for f in dataclasses.fields(Fp16Config) if f.name != "enabled"}


# DeepSpeed's spellings of a dtype in a config (its DtypeEnum) -> dslaunch's short name
DTYPE_SPELLINGS = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
                   **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
                   **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16")}


def _dtype_name(path: str, value: Any) -> str:
    if not isinstance(value, str) or value not in DTYPE_SPELLINGS:
        raise ConfigError(f"must be \"fp32\", \"fp16\" or \"bf16\" (or float32, float16, bfloat16), got "
                          f"{describe(value)}", key=path)
    return DTYPE_SPELLINGS[value]


def _patterns(path: str, value: Any) -> tuple[str, ...] | str:
    if value == "auto":
        return value
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"must be a list of module name patterns, or \"auto\", got {describe(value)}", key=path)
    return tuple(value)


DATA_TYPES_KEYS = ("grad_accum_dtype", "param_dtype", "buffer_dtype", "keep_in_fp32_modules")


@dataclass(frozen=True)
class DataTypesConfig:
    """``data_types``: the dtype gradients are summed in over an accumulation window, and how a
    16-bit model's parameters and buffers are cast (DeepSpeed 0.19.8's keys)."""

    grad_accum_dtype: str | None = _opt(None, optional(_dtype_name), "\"fp32\", \"fp16\" or \"bf16\" "
                                        "(null: the model's dtype)")
    """``"fp32"``, ``"fp16"``, ``"bf16"`` (DeepSpeed's other spellings are read as these) or None: the
    model's dtype."""
    param_dtype: str | None = _opt(None, optional(_dtype_name), "the dtype fp16/bf16 give the parameters, "
                                   "or null")
    """Must name the dtype the ``fp16``/``bf16`` blocks give the parameters (it only checks them)."""
    buffer_dtype: str | None = _opt(None, optional(_dtype_name), "\"fp32\", \"fp16\" or \"bf16\" "
                                    "(null: buffers keep the dtype they were loaded in)")
    """The floating-point buffers' dtype under fp16/bf16 (None: as loaded, DeepSpeed 0.19.8's default)."""
    keep_in_fp32_modules: tuple[str, ...] | str | None = _opt(None, optional(_patterns),
                                                              "a list of name patterns, or \"auto\"")
    """The buffers kept in fp32 (``runtime/precision/keep_in_fp32.py``): name patterns, or "auto"/None:
    the modules a Hugging Face model declares."""

    UNIMPLEMENTED = {}  # noqa: RUF012

    def check(self, fp16: bool, bf16: bool) -> None:
        """Gradients are summed in the model's dtype or, for an fp16/bf16 model, in fp32.

        Raises:
            ConfigError: a ``param_dtype`` other than the model's (DeepSpeed asserts).
            DtypeMixError: (a ``ConfigError`` and a ``NotImplementedError``) any other
                ``grad_accum_dtype``, naming the key (DeepSpeed raises ``NotImplementedError`` at
                stage 0 and runs some of them, an fp32 model's fp16 sums, at stages 1-3).
        """
        accum, model = self.grad_accum_dtype, "fp16" if fp16 else "bf16" if bf16 else "fp32"
        if self.param_dtype not in (None, model):
            raise ConfigError(f"\"{self.param_dtype}\" conflicts with the model dtype the fp16/bf16 blocks give "
                              f"({model}); set the matching fp16/bf16 \"enabled\" or remove it",
                              key="data_types.param_dtype")
        if accum is None or accum == model or (accum == "fp32" and model != "fp32"):
            return
        valid = "remove it or set it to \"fp32\"" if model == "fp32" else f"set it to \"fp32\" or \"{model}\""
        raise DtypeMixError(f"\"{accum}\" with {'a' if model == 'bf16' else 'an'} {model} model is not supported: "
                          f"gradients are summed in the model's dtype, or in fp32 for an fp16/bf16 model; {valid}",
                          key="data_types.grad_accum_dtype")


@dataclass(frozen=True)
class CheckpointConfig:
    """``checkpoint``: how checkpoints are validated and written (read by the checkpoint code)."""

    tag_validation: str = _opt("Warn", _tag_validation, "Ignore, Warn or Fail")
    async_save: bool = _opt(False, boolean, "true to write checkpoints in the background")
    keep_last: int | None = _opt(None, optional(integer(1)), "how many checkpoints to keep, "
                                 "or null to keep all")
    use_node_local_storage: bool = _opt(False, boolean, "true if each node saves to local disk")
    fsync: bool = _opt(True, boolean, "false to skip fsync as DeepSpeed does: a save then survives a "
                       "killed process but not a power loss")
    format: str = _opt("dslaunch", choice("dslaunch", "deepspeed"), "dslaunch (manifest, any world size on "
                       "load) or deepspeed (the files DeepSpeed 0.19's load_checkpoint reads at the saving "
                       "world size and stage); dslaunch-only")
    load_universal: bool = _opt(False, boolean, "true to load a universal checkpoint (ds_to_universal's "
                                "layout; the tag from latest_universal)")

    UNIMPLEMENTED = {"parallel_write": Off({"pipeline_stage": False}),
                     "writer": None, "checkpoint_serialization": True}


@dataclass(frozen=True)
class TypedSection:
    """``optimizer`` / ``scheduler``: a ``type`` name and its free-form ``params``."""

    type: str = _opt(None, optional(lambda p, v: v if isinstance(v, str) else _not_str(p, v)),
                     "a type name such as AdamW or WarmupLR")
    params: Mapping[str, Any] = _opt(None, optional(lambda p, v: v), "an object of parameters")

    UNIMPLEMENTED = {}  # noqa: RUF012


@dataclass(frozen=True)
class OptimizerSection(TypedSection):
    """``optimizer``: as ``TypedSection``, plus DeepSpeed's ``legacy_fusion`` (fp16 fused path)."""

    UNIMPLEMENTED = {"legacy_fusion": False}  # noqa: RUF012


def _not_str(path: str, value: Any) -> str:
    raise ConfigError(f"must be a string, got {describe(value)}", key=path)


# Top-level DeepSpeed keys dslaunch does not implement -> when they are off (DeepSpeed's
# runtime/config.py, constants.py and the feature configs it reads).
UNIMPLEMENTED_KEYS: dict[str, Any] = {
    # monitors, profilers, logging
    # DeepSpeed prints a throughput line by default; dslaunch has no throughput timer.
    "timers": Off({"throughput": Off({"enabled": False, "synchronized": True}, switch="enabled")}),
    "memory_breakdown": False, "dump_state": False,
    # precision and numerics
    "amp": _enabled(),
    "fp32_allreduce": False, "disable_allgather": False, "sparse_gradients": False,
    # parallelism
    "seq_parallel_comm_data_type": "fp32",
    "seq_parallel_communication_data_type": "fp32",  # the spelling DeepSpeed's docs use
    # model and training techniques
    "weight_quantization": None,
    "quantize_training": _enabled(), "eigenvalue": _enabled(),
    "compile": Off({"deepcompile": False}, switch="deepcompile"), "graph_harvesting": False,
    # checkpoint engines
    "nebula": _enabled(), "datastates_ckpt": False, "casync_ckpt": False, "async_load": False,
    # Keys that only tune features rejected above unless off (NVMe/CPU offload, a CPU optimizer
    # under offload, the tensor-core warning DeepSpeed prints): any value changes nothing.
    "zero_force_ds_cpu_optimizer": ANY, "vocabulary_size": ANY,
}


def _explain_auto(cls: type, raw: Mapping[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        f = fields.get(key)  # an unknown key is left to the did-you-mean below
        if value == "auto" and f is not None and not _stage3_only(cls, key) and key not in getattr(cls, "AUTO_OK", ()):
            what = f.metadata["help"]
            default = f" (or remove the key for the default, {f.default!r})"
            raise ConfigError(f"'auto' is a Hugging Face Trainer placeholder that only the Trainer fills "
                              f"in; put {what} here{default}", key=f"{prefix}.{key}" if prefix else key)


def _stage3_only(cls: type, key: str) -> bool:
    return getattr(cls, "STAGE3_ALIASES", {}).get(key, key) in getattr(cls, "STAGE3_ONLY", ())


def _default(f: dataclasses.Field) -> Any:
    """A field's default; a fresh one from its factory (a list field must not share one list)."""
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


class SectionClass(type):
    """A DeepSpeed config class name (``DeepSpeedZeroConfig``, ``DeepSpeedFP16Config``): calling
    it parses keyword settings into dslaunch's frozen section (its ``_parse``), and ``isinstance``
    accepts that section (its ``_parsed``). A bad value is a ``ConfigError`` that is also pydantic's
    ``ValidationError`` (DeepSpeed's classes are pydantic models), where pydantic is installed."""

    _parsed: type
    _parse: Callable[[dict[str, Any]], Any]

    def __call__(cls, **section: Any) -> Any:
        try:
            return cls._parse(section)
        except ConfigError as err:
            if type(err) is not ConfigError:  # a refusal (NotInDslaunchError) or DeepSpeed's assert
                raise
            from dslaunch.runtime.config_utils import as_validation_error

            raise as_validation_error(err, cls.__name__) from None

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, cls._parsed)


def parse_section(cls: type, raw: Any, prefix: str) -> Any:
    """Parse ``raw`` (a dict or None) into the frozen dataclass ``cls``.

    Raises:
        ConfigError: naming ``<prefix>.<key>`` for unknown keys (did-you-mean), bad values,
            ``"auto"``, or keys DeepSpeed has but dslaunch does not implement that are not off.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be an object, got {describe(raw)}", key=prefix)
    _explain_auto(cls, raw, prefix)
    known: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    spelt: dict[str, str] = {}  # setting -> the raw key that gave it
    for raw_key, value in raw.items():
        key = getattr(cls, "STAGE3_ALIASES", {}).get(raw_key, raw_key)
        if spelt.setdefault(key, raw_key) != raw_key:  # else the last spelling would silently win
            raise ConfigError(f"sets the same thing as '{prefix}.{spelt[key]}' (two spellings of one "
                              "setting); keep one", key=f"{prefix}.{raw_key}")
        if key in cls.UNIMPLEMENTED:
            reject_unimplemented(f"{prefix}.{key}", value, cls.UNIMPLEMENTED[key])
        elif value == "auto" and (_stage3_only(cls, key) or key in getattr(cls, "AUTO_OK", ())):
            continue  # the default stands ("auto" is what DeepSpeed's default means there)
        elif key in names or not _stage3_only(cls, key):
            known[key] = value
    fields = {f.name: Option(_default(f), f.metadata["check"]) for f in dataclasses.fields(cls)}
    # INERT keys are checked like the others (and suggested for typos), then dropped.
    inert = {key: Option(None, check) for key, check in getattr(cls, "INERT", {}).items()}
    params = check_params(known, {**fields, **inert}, prefix, f"section '{prefix}'")
    if params.get("enabled") is True:  # keys whose default serves only a disabled section (DeepSpeed's rule)
        for key in getattr(cls, "REQUIRED_WHEN_ENABLED", ()):
            if key not in known:
                raise ConfigError(f"is required when '{prefix}.enabled' is true (no default); add it, e.g. "
                                  f"{_json(fields[key].default)}", key=f"{prefix}.{key}")
    return cls(**{key: params[key] for key in fields})
