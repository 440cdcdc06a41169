"""``tensor_parallel.partition_config`` applied: the AutoTP plan from DeepSpeed's hand-written layer
rules (``runtime/config/partition_config.py``) instead of the dataflow trace (``auto_tp.py``).

Every Linear (``nn.Linear`` or GPT-2's ``Conv1D``) whose ``<name>.weight`` a rule matches is split
as the rule says, by DeepSpeed's sizes (``split.py``: by whole key/value heads when the model's
config gives them and the width is a multiple, else near even): a ``column`` rule keeps this
rank's output features (``gather_output``: a ``vocab``-kind shard, its slices gathered after it),
a ``row`` rule this rank's input features. A ``shape`` with sub-parameters splits each of them.
Where a row layer's input is all attention heads (the model's config), the attention module
holding it gets this rank's head counts (as the planner sets them).

Limitations (each refused in one line): an ``nn.Embedding`` or another module with a 2-D weight
matched by a non-skip rule (DeepSpeed splits embeddings over the hidden dimension, a layout
dslaunch's layers do not have), a ``shape`` of more than two dimensions or splitting a weight
along the other dimension than its rule's, ``gather_output`` with sub-parameters (DeepSpeed
refuses it too), and a ``row`` rule on the output layer (``lm_head_patterns``: its input is whole,
DeepSpeed scatters it first).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from dslaunch.errors import ConfigError
from dslaunch.runtime.config.partition_config import LayerSpec, PartitionConfig
from dslaunch.runtime.tensor_parallel.auto_tp import (
    Segments,
    ShardSpec,
    TPPlan,
    config_heads,
    is_linear,
    linear_shape,
    local_attributes,
)
from dslaunch.runtime.tensor_parallel.split import AutoTPMeta, get_shard_size_list

__all__ = ["plan_from_rules", "register_grad_allreduce"]

_KEY = "tensor_parallel.partition_config"


# DeepSpeed's fallback when the model has no config.model_type: a family name read off the model's
# class (``str(type(model))``), first pattern that matches
_CLASS_FAMILY = (re.compile(r"(\w+)DecoderLayer"), re.compile(r"(\w+)Block"), re.compile(r"(\w+)Layer"))


def _model_type(model: nn.Module) -> str | None:
    """The name ``model_types`` rules are matched against, as DeepSpeed's AutoTP finds it:
    ``config.model_type``, else the family in the model's class name (``GPT2Block`` -> ``gpt2``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if isinstance(model_type, str) and model_type:
        return model_type.lower()
    found = (pattern.search(str(type(model))) for pattern in _CLASS_FAMILY)
    return next((m.group(1).lower() for m in found if m is not None), None)


def _sub_sizes(spec: LayerSpec, name: str, whole: int, dim: int) -> list[int]:
    """The sub-parameter widths along the split dimension (one: the whole width)."""
    if spec.shape is None:
        return [whole]
    if len(spec.shape) != 2 or spec.split_dim != dim:
        raise ConfigError(f"{name}.weight: a shape of {len(spec.shape)} dimensions split at {spec.split_dim} is "
                          f"not implemented by dslaunch (a 2-D shape split at dimension {dim}, as the "
                          f"{spec.partition_type} rule's weight, is)", key=_KEY)
    sizes = spec.shape[dim]
    if isinstance(sizes, tuple):
        if sum(sizes) != whole:
            raise ConfigError(f"{name}.weight: sub-parameter sizes {list(sizes)} sum to {sum(sizes)}, not the "
                              f"weight's {whole}", key=_KEY)
        return list(sizes)
    if sizes == -1:
        return [whole]
    if whole % sizes:
        raise ConfigError(f"{name}.weight: {whole} features do not split into {sizes} equal sub-parameters", key=_KEY)
    return [whole // sizes] * sizes


def _segments(sub_sizes: list[int], tp: int, rank: int, meta: AutoTPMeta, name: str) -> tuple[Segments, list[int]]:
    """This rank's ranges of the split dimension, and every rank's total width."""
    segments, widths, offset = [], [0] * tp, 0
    for size in sub_sizes:
        shares = get_shard_size_list(size, tp, meta, name)
        start = offset + sum(shares[:rank])
        if shares[rank]:
            segments.append((start, start + shares[rank]))
        widths = [w + s for w, s in zip(widths, shares, strict=True)]
        offset += size
    return tuple(segments), widths


def _shard(module: nn.Module, name: str, spec: LayerSpec, rules: PartitionConfig, tp: int, rank: int,
           meta: AutoTPMeta) -> ShardSpec:
    out_features, in_features = linear_shape(module)
    if spec.partition_type == "row":
        if name.split(".")[-1] in rules.lm_head_patterns:
            raise ConfigError(f"{name}.weight: a row rule on the output layer is not implemented by dslaunch (its "
                              "input is whole); make it a column rule with \"gather_output\": true", key=_KEY)
        segments, _ = _segments(_sub_sizes(spec, name, in_features, 1), tp, rank, meta, name)
        return ShardSpec(name, "row", segments)
    sub_sizes = _sub_sizes(spec, name, out_features, 0)
    if spec.gather_output and len(sub_sizes) > 1:
        raise ConfigError(f"{name}.weight: gather_output with sub-parameters (shape) is not implemented (nor by "
                          "DeepSpeed); drop one of them", key=_KEY)
    segments, widths = _segments(sub_sizes, tp, rank, meta, name)
    if spec.gather_output:
        return ShardSpec(name, "vocab", segments, tuple(widths))
    return ShardSpec(name, "column", segments)


def plan_from_rules(model: nn.Module, rules: PartitionConfig, tp: int, rank: int) -> TPPlan:
    """This rank's plan for ``model`` under ``rules`` (see the module docstring).

    Raises:
        ConfigError: a Linear no rule matches under ``strict_mode``, or one of the limitations.
    """
    model_type = _model_type(model)
    meta = AutoTPMeta.from_model_config(getattr(model, "config", None))
    shards: list[ShardSpec] = []
    replicated: list[str] = []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        spec = rules.spec_for(f"{name}.weight", model_type)
        if spec is None and rules.strict_mode and is_linear(module):
            raise ConfigError(f"strict_mode: no layer_specs pattern matches {name}.weight; add a rule for it "
                              "(\"partition_type\": \"skip\" keeps it whole)", key=_KEY)
        if spec is None or spec.partition_type == "skip":
            if is_linear(module):
                replicated.append(name)
            continue
        if not is_linear(module):
            raise ConfigError(f"{name}.weight ({type(module).__name__}) matches a {spec.partition_type} rule: only "
                              "Linear layers are split by partition_config in dslaunch; narrow the pattern or add a "
                              "skip rule for it before", key=_KEY)
        shards.append(_shard(module, name, spec, rules, tp, rank, meta))
    return TPPlan(tuple(shards), tuple(_head_attributes(model, shards)), tuple(replicated))


def _head_attributes(model: nn.Module, shards: list[ShardSpec]) -> list[tuple[str, str, int]]:
    """The attention modules' head counts on this rank: where a row layer's input is all heads."""
    heads = config_heads(model)
    if heads is None:
        return []
    out: list[tuple[str, str, int]] = []
    for spec in shards:
        if spec.kind != "row" or linear_shape(model.get_submodule(spec.name))[1] != heads.heads * heads.head_dim:
            continue
        width = sum(b - a for a, b in spec.segments)
        if width % heads.head_dim:
            continue  # not whole heads: the model's own forward decides what that means
        q_heads = width // heads.head_dim
        scope = spec.name.rpartition(".")[0]
        out += local_attributes(model, scope, heads, q_heads, q_heads * heads.kv_heads // heads.heads)
    return list(dict.fromkeys(out))


def register_grad_allreduce(model: nn.Module, rules: PartitionConfig, group: Any) -> list[str]:
    """For each parameter a ``grad_allreduce`` skip rule matches: its gradient summed over the
    tensor group as it is computed (each rank's slice of the activations gives a part of it).
    Returns the names hooked.

    collective: the hooks run in every rank's backward, in the same order.
    """
    from dslaunch.runtime.comm import comm

    def summed(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=group)
        return grad

    model_type, hooked = _model_type(model), []
    for name, param in model.named_parameters():
        spec = rules.spec_for(name, model_type)
        if spec is not None and spec.grad_allreduce and param.requires_grad:
            param.register_hook(summed)
            hooked.append(name)
    return hooked
