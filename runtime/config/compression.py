"""The ds_config ``compression_training`` block: DeepSpeed Compression's techniques, parsed once.

Six techniques (``weight_quantization``, ``activation_quantization``, ``sparse_pruning``,
``row_pruning``, ``head_pruning``, ``channel_pruning``) share one shape: ``shared_parameters``
(``enabled``, ``schedule_offset`` and the technique's switches) and ``different_groups``, named
groups of ``modules`` (regular expressions searched in module names), optional ``related_modules``
(one list of patterns per ``modules`` pattern: the layers whose input shrinks with the pruned
rows/heads) and ``params`` (bits or ``dense_ratio``). ``layer_reduction`` copies teacher layers
into a shallower student. Keys, defaults and checks are DeepSpeed 0.19.6's (the last release with
the library); each bad key or value is one ``ConfigError`` naming its path. Torch-free.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dslaunch.errors import ConfigError, did_you_mean
from dslaunch.runtime.config.param_schema import (
    REQUIRED,
    Option,
    boolean,
    check_params,
    choice,
    describe,
    integer,
    number,
    string,
)

__all__ = ["TECHNIQUES", "CompressionGroup", "TechniqueConfig", "LayerReductionConfig", "CompressionConfig",
           "parse_compression"]

#: The techniques in DeepSpeed's order (the order layers are prepared in, so the order random
#: mask scores are drawn in).
TECHNIQUES = ("weight_quantization", "activation_quantization", "sparse_pruning", "row_pruning", "head_pruning",
              "channel_pruning")

_SYM = choice("symmetric", "asymmetric")
_RATIO = number(0.0, 1.0, low_open=True)
_STEP = integer(0)


def _bits(low: int) -> Any:
    return integer(low, 32)


def _mixed(path: str, value: Any) -> dict[str, Any]:
    return check_params(value, {"enabled": Option(False, boolean), "quantize_change_ratio": Option(0.001, number(0.0))},
                        path, "fp16_mixed_quantize")


def _kernel_off(path: str, value: Any) -> bool:
    if boolean(path, value):
        raise ConfigError("true needs DeepSpeed's CUDA quantizer kernel, which dslaunch does not have; set it to "
                          "false (the same quantization in torch ops)", key=path)
    return False


def _method(*methods: str) -> Any:
    check = choice(*methods)

    def method(path: str, value: Any) -> str:
        if value == "snip_momentum":
            raise ConfigError("snip_momentum pruning needs Intel Neural Compressor, which dslaunch does not "
                              "drive; use l1 or topk", key=path)
        if value == "l1" and "l1" not in methods:  # DeepSpeed's config takes it, then its layer raises
            raise ConfigError("head pruning scores heads with learned scores only; use topk", key=path)
        return check(path, value)

    return method


_COMMON = {"enabled": Option(False, boolean)}
# shared_parameters of each technique: its keys, DeepSpeed's defaults.
_SHARED: dict[str, dict[str, Option]] = {
    "weight_quantization": {**_COMMON, "schedule_offset": Option(0, _STEP), "quantize_groups": Option(1, integer(1)),
                            "quantizer_kernel": Option(False, _kernel_off), "quantize_verbose": Option(False, boolean),
                            "quantization_type": Option("symmetric", _SYM),
                            "rounding": Option("nearest", choice("nearest", "stochastic")),
                            "quantize_weight_in_forward": Option(False, boolean),
                            "fp16_mixed_quantize": Option(None, _mixed)},
    "activation_quantization": {**_COMMON, "schedule_offset": Option(1000, _STEP), "quantization_type": Option(
        "symmetric", _SYM), "range_calibration": Option("dynamic", choice("dynamic", "static"))},
    "sparse_pruning": {**_COMMON, "schedule_offset": Option(1000, _STEP), "schedule_offset_end": Option(None, _STEP),
                       "method": Option("l1", _method("l1", "topk", "snip_momentum"))},
    "row_pruning": {**_COMMON, "schedule_offset": Option(1000, _STEP), "method": Option("l1", _method("l1", "topk"))},
    "head_pruning": {**_COMMON, "schedule_offset": Option(1000, _STEP), "method": Option("topk", _method("topk")),
                     "num_heads": Option(None, integer(1))},
    "channel_pruning": {**_COMMON, "schedule_offset": Option(1000, _STEP),
                        "method": Option("l1", _method("l1", "topk"))},
}
_DENSE = {"dense_ratio": Option(REQUIRED, _RATIO)}
# params of each group.
_GROUP: dict[str, dict[str, Option]] = {
    "weight_quantization": {"start_bits": Option(REQUIRED, _bits(1)), "target_bits": Option(REQUIRED, _bits(1)),
                            "quantization_period": Option(1, integer(1))},
    "activation_quantization": {"bits": Option(REQUIRED, lambda p, v: _four_or_eight(p, v))},
    "sparse_pruning": _DENSE, "row_pruning": _DENSE, "head_pruning": _DENSE, "channel_pruning": _DENSE,
}


def _four_or_eight(path: str, value: Any) -> int:
    if value not in (4, 8) or isinstance(value, bool):
        raise ConfigError(f"must be 4 or 8 (the activation bits DeepSpeed supports), got {describe(value)}", key=path)
    return int(value)


class ReadOnlyDict(dict):
    """A dict that refuses changes, so the frozen config stays frozen; unlike ``MappingProxyType``
    it still copies, pickles and goes through ``dataclasses.asdict`` as a dict."""

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("the parsed compression_training config is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:
        return ReadOnlyDict, (dict(self),)

    def __deepcopy__(self, memo: dict) -> ReadOnlyDict:
        import copy

        return ReadOnlyDict(copy.deepcopy(dict(self), memo))


@dataclass(frozen=True)
class CompressionGroup:
    """One entry of ``different_groups``: where (``modules``) and how (``params``)."""

    name: str
    modules: tuple[str, ...]
    """Regular expressions; a compressible module whose dotted name one of them matches is in the group."""
    related_modules: tuple[tuple[str, ...], ...] | None
    """Per ``modules`` pattern, the patterns of the layers shrunk with it (pruning only)."""
    params: Mapping[str, Any]
    """The group's params, then the technique's shared parameters over them (as DeepSpeed merges them)."""


@dataclass(frozen=True)
class TechniqueConfig:
    """A technique's ``shared_parameters`` and its groups."""

    name: str
    shared: Mapping[str, Any] = field(default_factory=dict)
    groups: tuple[CompressionGroup, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.shared.get("enabled", False))

    @property
    def schedule_offset(self) -> int:
        return int(self.shared["schedule_offset"])


@dataclass(frozen=True)
class LayerReductionConfig:
    """``layer_reduction``: the student's layers ``0..len(teacher_layer)-1`` start as copies of
    the teacher's ``teacher_layer`` (under ``module_name_prefix``), plus ``other_module_name``."""

    enabled: bool = False
    keep_number_layer: int | None = None
    module_name_prefix: str = ""
    teacher_layer: tuple[int, ...] = ()
    other_module_name: tuple[str, ...] = ()


@dataclass(frozen=True)
class CompressionConfig:
    """The whole ``compression_training`` block (every technique off without it)."""

    techniques: tuple[TechniqueConfig, ...] = tuple(
        TechniqueConfig(t, ReadOnlyDict({"enabled": False, "schedule_offset": 0})) for t in TECHNIQUES)
    layer_reduction: LayerReductionConfig = field(default_factory=LayerReductionConfig)

    def technique(self, name: str) -> TechniqueConfig:
        return next(t for t in self.techniques if t.name == name)

    @property
    def enabled(self) -> bool:
        return self.layer_reduction.enabled or any(t.enabled for t in self.techniques)


def parse_compression(raw: Any, prefix: str = "compression_training") -> CompressionConfig:
    """Parse a ``compression_training`` block.

    Args:
        raw: the block (a dict; None is an empty one).
        prefix: the key path used in messages.

    Returns:
        The frozen ``CompressionConfig``.

    Raises:
        ConfigError: an unknown key (with did-you-mean), a bad value, a missing required key or an
            invalid module pattern, naming its full key path.
    """
    raw = _mapping(raw, prefix)
    _known(raw, (*TECHNIQUES, "layer_reduction"), prefix)
    techniques = tuple(_technique(name, raw.get(name), f"{prefix}.{name}") for name in TECHNIQUES)
    return CompressionConfig(techniques, _layer_reduction(raw.get("layer_reduction"), f"{prefix}.layer_reduction"))


def _mapping(raw: Any, path: str) -> Mapping[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"must be an object of settings, got {describe(raw)}", key=path)
    return raw


def _known(raw: Mapping[str, Any], keys: tuple[str, ...], path: str) -> None:
    for key in raw:
        if key not in keys:
            raise ConfigError(f"unknown key{did_you_mean(str(key), keys)}; valid keys: {', '.join(keys)}",
                              key=f"{path}.{key}")


def _technique(name: str, raw: Any, path: str) -> TechniqueConfig:
    raw = _mapping(raw, path)
    _known(raw, ("shared_parameters", "different_groups"), path)
    shared = check_params(raw.get("shared_parameters"), _SHARED[name], f"{path}.shared_parameters", name)
    if name == "weight_quantization" and shared["fp16_mixed_quantize"] is None:
        shared["fp16_mixed_quantize"] = {"enabled": False, "quantize_change_ratio": 0.001}
    if name == "sparse_pruning" and shared["schedule_offset_end"] is None:
        shared["schedule_offset_end"] = shared["schedule_offset"]
    if shared["enabled"] and name == "head_pruning" and shared["num_heads"] is None:
        raise ConfigError("must be given when head pruning is enabled (the attention heads of the pruned layers)",
                          key=f"{path}.shared_parameters.num_heads")
    if shared["enabled"] and "different_groups" not in raw:
        raise ConfigError(f"must be given when {name} is enabled (which modules, with which params)",
                          key=f"{path}.different_groups")
    groups = _mapping(raw.get("different_groups"), f"{path}.different_groups")
    if not shared["enabled"]:  # switched off: its groups are not read (DeepSpeed's would still assert on them)
        return TechniqueConfig(name, ReadOnlyDict(shared))
    parsed = tuple(_group(name, str(g), value, shared, f"{path}.different_groups.{g}") for g, value in groups.items())
    return TechniqueConfig(name, ReadOnlyDict(shared), parsed)


def _group(technique: str, name: str, raw: Any, shared: Mapping[str, Any], path: str) -> CompressionGroup:
    raw = _mapping(raw, path)
    _known(raw, ("params", "modules", "related_modules"), path)
    params = check_params(raw.get("params"), _GROUP[technique], f"{path}.params", f"{technique} group {name!r}")
    if technique == "weight_quantization" and params["target_bits"] > params["start_bits"]:
        raise ConfigError(f"must be <= start_bits ({params['start_bits']}): the bits only go down",
                          key=f"{path}.params.target_bits")
    modules = _patterns(raw.get("modules", ["*"]), f"{path}.modules")
    related = raw.get("related_modules")
    if related is not None:
        if not isinstance(related, (list, tuple)) or len(related) != len(modules):
            raise ConfigError(f"must be a list of {len(modules)} list(s) of patterns, one per 'modules' pattern, "
                              f"got {describe(related)}", key=f"{path}.related_modules")
        related = tuple(_patterns(r, f"{path}.related_modules[{i}]") for i, r in enumerate(related))
    return CompressionGroup(name, modules, related, ReadOnlyDict({**params, **shared}))


def _patterns(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"must be a list of module name patterns (regular expressions), got {describe(value)}",
                          key=path)
    out = []
    for i, pattern in enumerate(value):
        if pattern == "*":  # DeepSpeed's default spelling of "every module" (not a valid regex)
            pattern = ".*"
        try:
            re.compile(pattern)
        except re.error as err:
            raise ConfigError(f"is not a valid regular expression ({err}): {pattern!r}", key=f"{path}[{i}]") from None
        out.append(pattern)
    return tuple(out)


def _layer_reduction(raw: Any, path: str) -> LayerReductionConfig:
    raw = _mapping(raw, path)
    schema = {"enabled": Option(False, boolean), "keep_number_layer": Option(None, integer(1)),
              "module_name_prefix": Option("", string), "teacher_layer": Option([], _int_list),
              "other_module_name": Option([], _string_list)}
    got = check_params(raw, schema, path, "layer_reduction")
    if got["enabled"] and not got["module_name_prefix"]:
        raise ConfigError("must name the layers' container (e.g. bert.encoder.layer) when layer reduction is "
                          "enabled", key=f"{path}.module_name_prefix")
    if got["enabled"] and got["keep_number_layer"] is not None and got["keep_number_layer"] != len(got["teacher_layer"]):
        raise ConfigError(f"{got['keep_number_layer']} but teacher_layer lists {len(got['teacher_layer'])} layers",
                          key=f"{path}.keep_number_layer")
    return LayerReductionConfig(got["enabled"], got["keep_number_layer"], got["module_name_prefix"],
                                tuple(got["teacher_layer"]), tuple(got["other_module_name"]))


def _int_list(path: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"must be a list of layer indices, got {describe(value)}", key=path)
    return [integer(0)(f"{path}[{i}]", v) for i, v in enumerate(value)]


def _string_list(path: str, value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"must be a list of module names, got {describe(value)}", key=path)
    return [string(f"{path}[{i}]", v) for i, v in enumerate(value)]
