"""Putting an AutoTP plan in place: each planned module replaced by its sharded layer, each read
from a weight source as this rank's slice only, and the attention modules' head counts set to
this rank's.

Used by ``init_inference`` (weights from a checkpoint or the model, frozen, maybe int8) and by
training (the model's own weights, trainable, every shard marked ``tensor_model_parallel`` so
the gradient norm sums shards and counts whole parameters once: ``runtime.parallel.mpu``).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch
from torch import nn

from dslaunch.runtime.tensor_parallel.auto_tp import Segments, ShardSpec, TPPlan
from dslaunch.runtime.tensor_parallel.collectives import Collectives
from dslaunch.runtime.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLinear,
)

__all__ = ["WeightReader", "shard_modules", "replace_module", "set_local_attributes"]


class WeightReader(Protocol):
    """Where the shards are read from (``dslaunch.runtime.inference.loading``'s sources)."""

    def read(self, name: str, dim: int | None = None, segments: Segments | None = None) -> torch.Tensor: ...


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where the submodule ``name`` was."""
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _weight_dims(module: nn.Module) -> tuple[int, int]:
    """(output dim, input dim) of the stored weight: Conv1D stores ``[in, out]``."""
    return (0, 1) if isinstance(module, nn.Linear) else (1, 0)


def shard_modules(model: nn.Module, plan: TPPlan, source: WeightReader, dtype: torch.dtype, quantize: bool,
                  comms: Collectives, trainable: bool = False) -> None:
    """Put the planned column/row/vocab layers and vocab-parallel embeddings in place, each read from
    ``source`` as its slice only. A tensor tied to one already split (GPT-2's ``lm_head`` and its
    embedding, BERT's decoder bias) is not read again: every name that held it gets the same shard.

    ``trainable``: the shards require gradients and carry ``tensor_model_parallel = True``.
    """
    shards: dict[int, nn.Parameter] = {}  # id(whole tensor) -> this rank's shard of it
    wholes: list[torch.Tensor] = []  # alive until the end: their ids must not be reused meanwhile
    for spec in plan.shards:
        module = model.get_submodule(spec.name)
        originals = dict(module.named_parameters(recurse=False))
        wholes += originals.values()
        if spec.kind == "embedding":
            weight = shards.get(id(module.weight))
            if weight is None:
                weight = nn.Parameter(source.read(f"{spec.name}.weight", 0, spec.segments).to(dtype),
                                      requires_grad=trainable)
            new: nn.Module = VocabParallelEmbedding(weight, spec.segments[0][0], module.num_embeddings,
                                                    module.padding_idx, comms.all_reduce)
        else:
            new = _sharded_linear(spec, module, source, dtype, quantize, comms, shards, trainable)
        for attr, whole in originals.items():
            shards.setdefault(id(whole), getattr(new, attr))
        if trainable:
            _mark_shards(new, spec)
        replace_module(model, spec.name, new)
    for module in model.modules():  # other names of a split tensor: the same shard
        for attr, t in list(module._parameters.items()):
            if t is not None and id(t) in shards:
                module._parameters[attr] = shards[id(t)]


def _mark_shards(module: nn.Module, spec: ShardSpec) -> None:
    """Megatron's mark on the parameters each rank holds a different slice of (a row layer's bias
    is whole on every rank: unmarked, it counts once in the norm)."""
    for attr, p in module.named_parameters(recurse=False):
        if p is not None and not (spec.kind == "row" and attr == "bias"):
            p.tensor_model_parallel = True


def _sharded_linear(spec: ShardSpec, module: nn.Module, source: WeightReader, dtype: torch.dtype, quantize: bool,
                    comms: Collectives, shards: dict[int, nn.Parameter], trainable: bool) -> nn.Module:
    """The column/row/vocab layer for ``spec``, read from ``source`` (or a tied embedding's shard)."""
    out_dim, in_dim = _weight_dims(module)
    weight = shards.get(id(module.weight))  # tied to an embedding split just before: its shard, as it is
    if weight is None:
        weight = source.read(f"{spec.name}.weight", in_dim if spec.kind == "row" else out_dim, spec.segments)
        weight = weight.t().contiguous() if out_dim == 1 else weight
    has_bias = getattr(module, "bias", None) is not None
    enter = comms.enter if trainable else None
    pieces = None if comms.pieces is None else comms.pieces.of(spec.segments)
    if spec.kind == "row":
        bias = source.read(f"{spec.name}.bias") if has_bias else None
        return RowParallelLinear(weight, bias, quantize, dtype, comms.all_reduce, trainable, pieces)
    bias = source.read(f"{spec.name}.bias", 0, spec.segments) if has_bias else None
    if spec.kind == "vocab":
        return VocabParallelLinear(weight, bias, quantize, dtype, partial(comms.gather, widths=list(spec.widths)),
                                   trainable, enter, pieces)
    return ColumnParallelLinear(weight, bias, quantize, dtype, trainable, enter, pieces)


def set_local_attributes(model: nn.Module, plan: TPPlan) -> None:
    """The attention modules' head counts and widths set to this rank's (the model's own forward
    then reshapes its sharded q/k/v by them)."""
    for module_name, attr, value in plan.attributes:
        setattr(model.get_submodule(module_name), attr, value)
