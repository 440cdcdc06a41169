"""DeepSpeed Compression's model surgery (``deepspeed.compression.compress`` and ``.helper``).

``init_compression`` replaces every compressible layer (``nn.Linear``, ``nn.Conv2d``,
``nn.Embedding``, ``nn.BatchNorm2d``) by its compressing twin (``layers.py``), then prepares each
configured technique on the layers its groups' ``modules`` patterns match (``re.search`` on the
dotted module name; a layer may be in one group per technique). The scheduler turns them on
during training. ``redundancy_clean`` makes them permanent: quantized weights stored, pruned
weights zeroed, and where a group names ``related_modules`` the pruned rows/heads/channels are
removed from the layer and the matching inputs from the related layers (smaller weights).
``student_initialization`` is layer reduction's copy of teacher layers.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.compression.layers import (
    BNLayer_Compress,
    Conv2dLayer_Compress,
    Embedding_Compress,
    LinearLayer_Compress,
)
from dslaunch.runtime.config.compression import (
    CompressionConfig,
    CompressionGroup,
    TechniqueConfig,
    parse_compression,
)

__all__ = ["model_get", "compression_config", "is_module_compressible", "matched_modules", "GroupTargets", "group_targets",
           "module_replacement", "init_compression", "redundancy_clean", "student_initialization",
           "convert_conv1d_to_linear"]

_COMPRESSIBLE = (nn.Linear, nn.Conv2d, nn.Embedding, nn.BatchNorm2d)
# redundancy_clean's order: quantize before pruning shrinks a weight
_CLEAN_ORDER = ("weight_quantization", "sparse_pruning", "row_pruning", "head_pruning", "channel_pruning",
                "activation_quantization")


def model_get(model: nn.Module, name: str) -> nn.Module:
    """``model.a.b.c`` for ``name="a.b.c"``."""
    return model.get_submodule(name)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, last = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, last, module)


def compression_config(deepspeed_config: Any) -> CompressionConfig:
    """The ``compression_training`` block of a ds_config given as a dict, a JSON file's path or a
    parsed ``DeepSpeedConfig`` (or the parsed block itself).

    Raises:
        ConfigError: the file is missing or unreadable, or the block is invalid (naming the key).
    """
    if isinstance(deepspeed_config, CompressionConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, (str, os.PathLike)):
        from dslaunch.runtime.config.file import read_config_file

        path = Path(deepspeed_config)
        if not path.is_file():
            raise ConfigError(f"no such ds_config file: {path} (pass a dict or the path of a JSON file)")
        deepspeed_config = read_config_file(path)
    parsed = getattr(deepspeed_config, "compression_training", None)
    if isinstance(parsed, CompressionConfig):
        return parsed
    if not isinstance(deepspeed_config, Mapping):
        raise ConfigError(f"expected a ds_config dict or the path of a JSON file, got {type(deepspeed_config).__name__}")
    return parse_compression(deepspeed_config.get("compression_training"))


def is_module_compressible(module: nn.Module, mpu: Any = None) -> bool:
    """True for the layers compression replaces (and the mpu's parallel linears, which dslaunch refuses)."""
    parallel = tuple(getattr(mpu, n) for n in ("RowParallelLinear", "ColumnParallelLinear") if hasattr(mpu, n))
    return isinstance(module, _COMPRESSIBLE + parallel)


def matched_modules(model: nn.Module, pattern: str, taken: set[str] | None, mpu: Any = None) -> list[str]:
    """Compressible module names ``pattern`` finds, in ``named_modules`` order; names in ``taken``
    (this technique's other groups) are an error, new ones are added to it.

    Raises:
        ConfigError: a module is in two groups of one technique.
    """
    found = []
    for name, module in model.named_modules():
        if re.search(pattern, name) is None or not is_module_compressible(module, mpu):
            continue
        if taken is not None:
            if name in taken:
                raise ConfigError(f"module {name!r} (matched by {pattern!r}) is already in another group of this "
                                  "technique; each module takes one group's settings")
            taken.add(name)
        found.append(name)
    return found


@dataclass(frozen=True)
class GroupTargets:
    """One group's layers: per ``modules`` pattern its matches, and per related pattern its matches."""

    technique: str
    group: CompressionGroup
    modules: tuple[tuple[str, ...], ...]
    related: tuple[tuple[tuple[str, ...], ...], ...]


def group_targets(model: nn.Module, technique: TechniqueConfig, mpu: Any = None) -> Iterator[GroupTargets]:
    """The layers of each of ``technique``'s groups in ``model``.

    Raises:
        ConfigError: a module in two groups of the technique.
    """
    taken: set[str] = set()
    for group in technique.groups:
        modules = tuple(tuple(matched_modules(model, p, taken, mpu)) for p in group.modules)
        related = tuple(tuple(tuple(matched_modules(model, r, None, mpu)) for r in rel)
                        for rel in (group.related_modules or ()))
        yield GroupTargets(technique.name, group, modules, related)


def _twin(old: nn.Module, mpu: Any) -> nn.Module | None:
    """A compressing copy of ``old`` (``old`` itself if it already is one); its init draws from
    the RNG as DeepSpeed's does, so later mask scores match."""
    if isinstance(old, (LinearLayer_Compress, Conv2dLayer_Compress, Embedding_Compress)):
        return old
    w = old.weight
    if isinstance(old, nn.Linear):
        new = LinearLayer_Compress(old.in_features, old.out_features, bias=old.bias is not None)
    elif isinstance(old, nn.Conv2d):
        new = Conv2dLayer_Compress(old.in_channels, old.out_channels, old.kernel_size, old.stride, old.padding,
                                   old.dilation, old.groups, old.bias is not None, old.padding_mode)
    elif isinstance(old, nn.BatchNorm2d):
        new = BNLayer_Compress(old.num_features, old.eps, old.momentum, old.affine, old.track_running_stats)
        new.running_mean.data, new.running_var.data = old.running_mean.data, old.running_var.data
    elif isinstance(old, nn.Embedding):
        new = Embedding_Compress(old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
                                 old.scale_grad_by_freq, old.sparse)
    elif is_module_compressible(old, mpu):
        from dslaunch.errors import NotInDslaunchError

        raise NotInDslaunchError(f"{type(old).__name__}: compressing Megatron's model-parallel linear layers is not "
                                 "in dslaunch; compress a model of torch.nn layers (AutoTP shards them afterwards)")
    else:
        return None
    new = new.to(device=w.device, dtype=w.dtype)
    new.weight.data = w.data
    if getattr(old, "bias", None) is not None:
        new.bias.data = old.bias.data
    return new


def _enable(module: nn.Module, technique: str, p: Mapping[str, Any]) -> None:
    if not p["enabled"]:
        return
    if technique == "weight_quantization":
        module.enable_weight_quantization(p["start_bits"], p["target_bits"], p["quantization_period"],
                                          p["quantize_weight_in_forward"], p["quantization_type"], p["quantize_groups"])
    elif technique == "activation_quantization":
        module.enable_activation_quantization(p["bits"], p["quantization_type"], p["range_calibration"])
    elif technique == "head_pruning":
        module.enable_head_pruning(p["dense_ratio"], p["method"], p["num_heads"])
    else:  # sparse, row, channel
        getattr(module, f"enable_{technique}")(p["dense_ratio"], p["method"])


def module_replacement(model: nn.Module, module_name: str, technique: tuple[str, Mapping[str, Any]] | None = None,
                       mpu: Any = None) -> None:
    """Put the compressing twin of ``model.<module_name>`` in its place and, given ``technique``
    (its name and a group's merged params), prepare it.

    Raises:
        ConfigError: the technique does not apply to that kind of layer (e.g. row pruning of a
            convolution), naming the module.
    """
    new = _twin(model_get(model, module_name), mpu)
    if new is None:  # not a layer compression knows: left as it is
        return
    if technique is not None:
        name, params = technique
        if not hasattr(new, f"enable_{name}") and params["enabled"]:
            raise ConfigError(f"{name} does not apply to {module_name!r} ({type(new).__name__}); narrow the group's "
                              "'modules' patterns", key=f"compression_training.{name}.different_groups")
        _enable(new, name, params)
    _set(model, module_name, new)


def _inner(model: Any) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def init_compression(model: nn.Module, deepspeed_config: Any, teacher_model: nn.Module | None = None,
                     mpu: Any = None) -> nn.Module:
    """Prepare ``model`` for compression-aware training as its ``compression_training`` block says.

    Args:
        model: the model (or a wrapper with ``.module``); changed in place.
        deepspeed_config: a ds_config dict, JSON path or ``DeepSpeedConfig``.
        teacher_model: the model layer reduction copies layers from.
        mpu: a Megatron mpu (its parallel linears are refused).

    Returns:
        ``model``, its compressible layers replaced.

    Raises:
        ConfigError: a bad block, a module in two groups, a technique on a layer it does not fit,
            or layer reduction without ``teacher_model``.
    """
    config = compression_config(deepspeed_config)
    inner = _inner(model)
    if config.layer_reduction.enabled:
        if teacher_model is None:
            raise ConfigError("is enabled, so init_compression needs teacher_model (the model to copy layers from)",
                              key="compression_training.layer_reduction.enabled")
        student_initialization(inner, teacher_model, config)
    targets = [t for tech in config.techniques for t in group_targets(inner, tech, mpu)]
    for name, module in list(inner.named_modules()):
        if is_module_compressible(module, mpu):
            module_replacement(inner, name, mpu=mpu)
    for target in targets:
        for names in target.modules:
            for name in names:
                module_replacement(inner, name, (target.technique, target.group.params), mpu)
    return model


def _fix(model: nn.Module, name: str, technique: str, p: Mapping[str, Any], mask: torch.Tensor | None = None,
         dim_reduction: bool = False) -> torch.Tensor | None:
    """Make ``technique`` permanent on one layer; the kept-units mask of a pruning, else None."""
    module = model_get(model, name)
    if technique == "weight_quantization" and p["quantize_weight_in_forward"] and p["enabled"]:
        return module.fix_weight_quantization()
    if technique == "sparse_pruning" and p["enabled"]:
        return module.fix_sparse_pruning_helper()
    if not (p["enabled"] or mask is not None):
        return None
    if technique == "row_pruning":
        return module.fix_row_col_pruning_helper(mask, dim_reduction=dim_reduction)
    if technique == "head_pruning":
        return module.fix_head_pruning_helper(mask, p["num_heads"], dim_reduction=dim_reduction)
    if technique == "channel_pruning":
        return module.fix_channel_pruning_helper(mask, dim_reduction=dim_reduction)
    return None


def redundancy_clean(model: nn.Module, deepspeed_config: Any, mpu: Any = None) -> nn.Module:
    """Make the model's compression permanent (after training), shrinking what was pruned.

    With ``related_modules``, the k-th layer a ``modules`` pattern matched hands its kept-units
    mask to the k-th layer each of its related patterns matched (layer i's FFN output feeds layer
    i's next projection), whose input columns/channels are cut to match.

    Args:
        model: the model ``init_compression`` prepared (or a wrapper with ``.module``).
        deepspeed_config: the same ds_config.
        mpu: as for ``init_compression``.

    Returns:
        ``model``, changed in place.

    Raises:
        ConfigError: a bad block, or a related pattern matching more layers than its pattern did.
    """
    config = compression_config(deepspeed_config)
    inner = _inner(model)
    targets = [t for tech in config.techniques for t in group_targets(inner, tech, mpu)]
    targets.sort(key=lambda t: _CLEAN_ORDER.index(t.technique))
    for target in targets:
        params, shrink = target.group.params, bool(target.related)
        for i, names in enumerate(target.modules):
            masks = [_fix(inner, name, target.technique, params, dim_reduction=shrink) for name in names]
            for related in target.related[i] if shrink else ():
                if len(related) > len(masks):
                    raise ConfigError(f"{len(related)} related layers ({', '.join(related)}) but only {len(masks)} "
                                      f"pruned layer(s) to take the masks from ({', '.join(names)})",
                                      key=f"compression_training.{target.technique}.different_groups."
                                          f"{target.group.name}.related_modules")
                for name, mask in zip(related, masks, strict=False):  # checked: no more related than masks
                    _fix(inner, name, target.technique, params, mask=mask, dim_reduction=True)
    return model


def student_initialization(student_model: nn.Module, teacher_model: nn.Module, deepspeed_config: Any) -> None:
    """Layer reduction: student layer ``i`` (under ``module_name_prefix``) takes the weights of
    teacher layer ``teacher_layer[i]``, and each ``other_module_name`` module the teacher's.

    Args:
        student_model: the shallower model, changed in place.
        teacher_model: the model copied from.
        deepspeed_config: a ds_config dict, JSON path or ``DeepSpeedConfig``.

    Raises:
        ConfigError: a named module missing in either model, or parameters of different shapes.
    """
    lr = compression_config(deepspeed_config).layer_reduction
    pairs = [(f"{lr.module_name_prefix}.{s}", f"{lr.module_name_prefix}.{t}") for s, t in enumerate(lr.teacher_layer)]
    for student_name, teacher_name in [*pairs, *((n, n) for n in lr.other_module_name)]:
        student, teacher = _named(student_model, student_name, "student"), _named(teacher_model, teacher_name, "teacher")
        s_params, t_params = list(student.named_parameters()), list(teacher.named_parameters())
        if len(s_params) != len(t_params):
            raise ConfigError(f"student {student_name} has {len(s_params)} parameters but teacher {teacher_name} has "
                              f"{len(t_params)}: the copied modules must have the same structure",
                              key="compression_training.layer_reduction")
        for (sn, s), (_, t) in zip(s_params, t_params, strict=True):
            if s.shape != t.shape:
                raise ConfigError(f"student {student_name}.{sn} is {tuple(s.shape)} but teacher {teacher_name}.{sn} "
                                  f"is {tuple(t.shape)}", key="compression_training.layer_reduction")
            with torch.no_grad():
                s.copy_(t)


def _named(model: nn.Module, name: str, which: str) -> nn.Module:
    try:
        return model_get(model, name)
    except AttributeError:
        raise ConfigError(f"the {which} model has no module {name!r}",
                          key="compression_training.layer_reduction") from None


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace each ``convert_type`` module (GPT-2's ``Conv1D``: a linear layer with its weight
    stored ``(in, out)``) by an equal ``nn.Linear``.

    Args:
        model: the model (or a wrapper with ``.module``); changed in place.
        convert_type: the class to convert.

    Returns:
        ``model``.
    """
    inner = _inner(model)
    for name, module in list(inner.named_modules()):
        if isinstance(module, convert_type):
            w = module.weight.data
            linear = nn.Linear(w.size(0), w.size(1), bias=module.bias is not None)
            linear.weight.data = w.t().contiguous()
            if module.bias is not None:
                linear.bias.data = module.bias.data.view(-1)
            _set(inner, name, linear)
    return model
