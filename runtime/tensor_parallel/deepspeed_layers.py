"""DeepSpeed's AutoTP layers built by hand around an existing ``nn.Linear``
(``deepspeed.module_inject.layers``): ``LinearLayer`` (column-parallel) and ``LinearAllreduce``
(row-parallel), for models that place their tensor-parallel layers themselves.

``LinearLayer(module, mp_group)`` keeps this rank's rows of ``module.weight`` (and of its bias),
``LinearAllreduce(module, mp_group)`` this rank's columns (the bias stays whole); the split is
DeepSpeed's (``split.py``: near even, the first ranks one longer). The module's own ``Parameter``
objects are kept, their data cut to the slice (an optimizer built on them stays valid), and are
marked ``tensor_model_parallel`` (the gradient norm sums their slices; a row layer's bias counts
once) with DeepSpeed's ``gather_params([p])`` / ``_tp_partition([p])`` attached: whole again, then
sliced again, in place.

The math and the collectives are dslaunch's sharded layers' (``layers.py``, ``collectives.py``
with autograd): the column layer sums its input gradient over the group, the row layer sums its
output (``gather_output``: the column layer's slices are concatenated, every rank gets the whole
output). The parameters keep their ``requires_grad`` when DeepSpeed's mode is training
(``mode.py``: ``initialize`` with AutoTP sets it) and are frozen otherwise, as DeepSpeed's.
``initialize`` records their slices in the checkpoint layout (``hand_built_layout``), as the
planner's: a tag saved at one degree loads at another.

collective: forward and backward, ``gather_params`` and every construction with a group run on
every rank of ``mp_group``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from dslaunch.runtime.tensor_parallel.collectives import NO_COLLECTIVES, gather_last_dim, training_collectives
from dslaunch.runtime.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from dslaunch.runtime.tensor_parallel.mode import is_autotp_training_mode
from dslaunch.runtime.tensor_parallel.split import AutoTPMeta, get_shard_size_list

__all__ = ["TensorParallelLayer", "LinearLayer", "LinearAllreduce", "GatherReplacedLayerParams", "gather_dim",
           "hand_built_layout", "TP_MARK"]

TP_MARK = "tensor_model_parallel"  # Megatron's and DeepSpeed's mark on a parameter split over the tensor group


def _geometry(group: Any) -> tuple[int, int]:
    """(ranks, this rank) of the tensor-parallel group; (1, 0) without one."""
    if group is None:
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def gather_dim(local: torch.Tensor, sizes: list[int], dim: int, group: Any) -> torch.Tensor:
    """Every rank's ``local`` (``sizes[r]`` wide along ``dim``) concatenated along ``dim`` in rank order.

    collective: every rank of ``group``.
    """
    return gather_last_dim(local.movedim(dim, -1), sizes, group).movedim(-1, dim).contiguous()


class TensorParallelLayer:
    """The base of the hand-built layers (DeepSpeed's ``TensorParallel_Layer``): what they answer
    beyond the math, the group geometry, the split and the parameter hooks (``gather_params`` /
    ``_tp_partition``)."""

    mp_group: Any
    tp_world_size: int
    tp_index: int
    _partition_sizes: tuple[int, ...]
    _split_dim: int  # the weight's dimension split over the group (0: column, 1: row)

    def _setup(self, group: Any, name: str | None, meta: AutoTPMeta | None, total: int) -> None:
        self.mp_group, self.name = group, name
        self.tp_world_size, self.tp_index = _geometry(group)
        self.world_size, self.rank = self.tp_world_size, self.tp_index  # DeepSpeed's older names
        self.is_tp_parallel = self.tp_world_size > 1
        self.support_training = True
        self.tp_meta = meta or AutoTPMeta()
        self._partition_sizes = tuple(get_shard_size_list(total, self.tp_world_size, self.tp_meta, name))

    def _slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.detach().split(self._partition_sizes, dim=dim)[self.tp_index].clone()

    def _mark(self, param: nn.Parameter, split: bool) -> None:
        if not is_autotp_training_mode():  # inference freezes; training keeps what the caller set
            param.requires_grad_(False)
        if split:
            setattr(param, TP_MARK, True)
            param.ds_is_replaced_module = True
            param.gather_params, param._tp_partition = self.gather_params, self._tp_partition

    @torch.no_grad()
    def whole(self, p: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """A whole copy of this layer's parameter ``p`` (``p`` itself unchanged), from ``value``
        (this rank's slice of it; default ``p``'s own: ZeRO-3 passes the gathered one). collective."""
        value = p if value is None else value
        if (self.is_tp_parallel and getattr(p, TP_MARK, False)
                and value.shape[self._dim(value)] != sum(self._partition_sizes)):
            return gather_dim(value.detach(), list(self._partition_sizes), self._dim(value), self.mp_group)
        return value.detach().clone()

    @torch.no_grad()
    def gather_params(self, params_list: list[torch.Tensor | None]) -> None:
        """Each split parameter of ``params_list`` made whole again, in place (collective)."""
        for p in params_list:
            if p is not None and getattr(p, TP_MARK, False):
                p.data = self.whole(p)

    @torch.no_grad()
    def _tp_partition(self, params_list: list[torch.Tensor | None]) -> None:
        """Each split parameter of ``params_list`` cut back to this rank's slice, in place."""
        for p in params_list:
            if p is not None and getattr(p, TP_MARK, False) and p.shape[self._dim(p)] == sum(self._partition_sizes):
                p.data = self._slice(p.data, self._dim(p))

    def __deepcopy__(self, memo: dict) -> TensorParallelLayer:
        """A copy sharing the process group (a group cannot be copied; DeepSpeed's copies share it)."""
        memo[id(self.mp_group)] = self.mp_group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return new

    def tensor_layout(self) -> dict[str, list]:
        """This rank's slice of each split parameter, by attribute, in the planner's layout
        (``training.tensor_layout``: ``[dim, segments, whole size, transposed]``)."""
        start = sum(self._partition_sizes[:self.tp_index])
        stop = start + self._partition_sizes[self.tp_index]
        total = sum(self._partition_sizes)
        return {attr: [self._dim(p), [[start, stop]], total, False] for attr, p in self.named_parameters(recurse=False)
                if getattr(p, TP_MARK, False) and p.shape[self._dim(p)] == stop - start != total}

    def _dim(self, p: torch.Tensor) -> int:
        return min(self._split_dim, p.dim() - 1)  # a column layer's bias is split along its only dim


class _AnswersFor(type):
    """``isinstance(m, LinearLayer)`` is also true of the planner's column (and vocab) layers, and
    ``isinstance(m, LinearAllreduce)`` of its row layers: code that finds the layers AutoTP split
    by DeepSpeed's classes finds the ones ``initialize`` put in place."""

    also: type

    def __instancecheck__(cls, obj: Any) -> bool:
        return super().__instancecheck__(obj) or isinstance(obj, cls.also)


def _collectives(group: Any, size: int) -> Any:
    return training_collectives(group) if size > 1 else NO_COLLECTIVES


class LinearLayer(TensorParallelLayer, ColumnParallelLinear, metaclass=_AnswersFor):
    """DeepSpeed's column-parallel layer: this rank's output features of ``module``.

    Args:
        module: an ``nn.Linear``; its parameters become this layer's (cut to the slice).
        mp_group: the tensor-parallel group (None: one rank, nothing is split).
        skip_partition: keep the parameters as they are (already this rank's slice).
        gather_output: return the whole output on every rank (its slices gathered).
        name: the layer's name (the split reads it, as DeepSpeed's: ``mlp``, ``lm_head``...).
        tp_meta: the model's head geometry (``AutoTPMeta``).
    """

    _split_dim = 0
    also = ColumnParallelLinear

    def __init__(self, module: nn.Module, mp_group: Any = None, skip_partition: bool = False,
                 gather_output: bool = False, **kwargs: Any):
        self._setup(mp_group, kwargs.get("name"), kwargs.get("tp_meta"), module.weight.shape[0])
        weight, bias = module.weight, module.bias
        if not skip_partition and self.is_tp_parallel:
            for p in (weight, bias):
                if p is not None:
                    p.data = self._slice(p.data, 0)
        comms = _collectives(mp_group, self.tp_world_size)
        super().__init__(weight, bias, False, weight.dtype, trainable=True, enter=comms.enter)
        self.bias = bias  # the module's own Parameter (the base class would copy it)
        self.gather_output = gather_output
        self._comms = comms
        for p in (weight, bias):
            if p is not None:
                self._mark(p, split=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return self._comms.gather(out, list(self._partition_sizes)) if self.gather_output else out


class LinearAllreduce(TensorParallelLayer, RowParallelLinear, metaclass=_AnswersFor):
    """DeepSpeed's row-parallel layer: this rank's input features of ``module``; the partial
    outputs are summed over the group, then the whole bias is added once.

    Args:
        module: an ``nn.Linear``; its parameters become this layer's (the weight cut to the slice).
        mp_group: the tensor-parallel group (None: one rank).
        name, tp_meta: as ``LinearLayer``'s.
    """

    _split_dim = 1
    also = RowParallelLinear

    def __init__(self, module: nn.Module, mp_group: Any = None, **kwargs: Any):
        self._setup(mp_group, kwargs.get("name"), kwargs.get("tp_meta"), module.weight.shape[1])
        weight, bias = module.weight, module.bias
        if self.is_tp_parallel:
            weight.data = self._slice(weight.data, 1)
        comms = _collectives(mp_group, self.tp_world_size)
        super().__init__(weight, bias, False, weight.dtype, comms.all_reduce, trainable=True)
        self.bias = bias  # the module's own Parameter (the base class would copy it)
        self._mark(weight, split=True)
        if bias is not None:
            self._mark(bias, split=False)


class GatherReplacedLayerParams:
    """DeepSpeed's context manager: the split parameters among ``params`` whole inside the block
    (``gather_params``), cut back to this rank's slices after it. Parameters of no hand-built
    layer pass through untouched.

    collective: entering and leaving run on every rank of the layers' group.
    """

    def __init__(self, params: Any, module: nn.Module, enabled: bool = True):
        self.params = [params] if isinstance(params, torch.Tensor) else list(params)
        self.module = module
        self._owner = next((p for p in self.params if hasattr(p, "gather_params")), None) if enabled else None
        self.enabled = self._owner is not None

    def __enter__(self) -> None:
        if self._owner is not None:
            self._owner.gather_params(self.params)

    def __exit__(self, *exc: Any) -> None:
        if self._owner is not None:
            self._owner._tp_partition(self.params)


def hand_built_layout(model: nn.Module, tp_size: int) -> dict[str, list]:
    """The slices of the hand-built layers of ``model`` split over ``tp_size`` ranks, by parameter
    name (checkpoints record them as the planner's: a tag then loads at another degree)."""
    out: dict[str, list] = {}
    for prefix, m in model.named_modules():
        if isinstance(m, TensorParallelLayer) and m.tp_world_size == tp_size:
            out.update({f"{prefix}.{attr}" if prefix else attr: entry for attr, entry in m.tensor_layout().items()})
    return out
