"""DeepSpeed's ``deepspeed.runtime.utils``: the helpers training scripts import from it.

Seeding (``set_random_seed``), memory reports (``see_memory_usage``, ``memory_status``), gradient
and weight norms (``clip_grad_norm_``, ``get_global_norm``, ``get_grad_norm``, ``get_weight_norm``),
pipeline partitioning (``partition_uniform``, ``partition_balanced``: the pipeline's own), the
overflow check of DeepSpeed's fp16 wrappers (``CheckOverflow``, ``has_inf_or_nan``,
``is_invalid_grad_norm``: for a script's own optimizer loop; dslaunch's engine finds an overflow
as the non-finite global norm of the ZeRO step), and small conveniences (``move_to_device``, ``call_to_str``, ``noop_decorator``, ...). Same signatures and
results as DeepSpeed's for a job without expert or tensor parallelism; with an ``mpu`` the norms
are summed (max for inf) over its model-parallel group, as DeepSpeed's.

Collective: ``clip_grad_norm_`` and the norms given an ``mpu`` all-reduce when torch.distributed
is initialised; call them on every rank. Without it they are local. ``CheckOverflow`` all-reduces
where its docstring says.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dslaunch.runtime.parallel.mpu import (
    bwc_pipeline_parallel_group,
    bwc_pipeline_parallel_world_size,
    bwc_tensor_model_parallel_rank,
)
from dslaunch.runtime.partitioned_tensor import PartitionedTensor
from dslaunch.runtime.pipe.module import partition_balanced, partition_uniform
from dslaunch.safe_write import make_dirs

__all__ = ["set_random_seed", "see_memory_usage", "memory_status", "empty_cache", "get_ma_status",
           "clip_grad_norm_", "get_global_norm", "get_grad_norm", "get_weight_norm", "get_grad_zeros",
           "is_model_parallel_parameter", "partition_uniform", "partition_balanced", "prefix_sum_inc",
           "move_to_device", "call_to_str", "get_only_unique_item", "noop_decorator", "noop_context",
           "ensure_directory_exists", "DummyOptim", "PartitionedTensor", "CheckOverflow", "has_inf_or_nan",
           "grads_overflow", "is_invalid_grad_norm",
           # DeepSpeed imports these from deepspeed.utils.bwc at its module level
           "bwc_tensor_model_parallel_rank", "bwc_pipeline_parallel_world_size", "bwc_pipeline_parallel_group"]

_GIB = 1024 ** 3


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (all devices) with ``seed``."""
    import numpy

    random.seed(seed)
    numpy.random.seed(seed % 2 ** 32)  # NumPy takes 32-bit seeds only
    torch.manual_seed(seed % 2 ** 63)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank() -> int:
    return torch.distributed.get_rank() if _dist_ready() else 0


def _accelerator() -> Any:
    from dslaunch.runtime.accelerator import get_accelerator

    return get_accelerator()


def see_memory_usage(message: str, force: bool = False) -> None:
    """Print ``message`` and the device's and host's memory use, on rank 0, only when ``force``.

    DeepSpeed calls it all over with ``force=False`` (a no-op), so scripts do too. Resets the
    device's peak counters afterwards, so the next report shows the peak since this one.
    """
    if not force or _rank() != 0:
        return
    import psutil

    gc.collect()  # count what is really alive
    acc = _accelerator()
    print(message)
    print(f"MA {acc.memory_allocated() / _GIB:.2f} GB  Max_MA {acc.max_memory_allocated() / _GIB:.2f} GB  "
          f"CA {acc.memory_reserved() / _GIB:.2f} GB  Max_CA {acc.max_memory_reserved() / _GIB:.2f} GB")
    vm = psutil.virtual_memory()
    print(f"CPU Virtual Memory:  used = {(vm.total - vm.available) / _GIB:.2f} GB, percent = {vm.percent}%")
    acc._reset_peak()


_last_status = {"allocated": 0, "reserved": 0}


def memory_status(msg: str, print_rank: int = -1, reset_max: bool = False) -> None:
    """One ``RANK=r MEMSTATS msg ...`` line: allocated and reserved memory, change since the last call."""
    rank = _rank()
    if print_rank != -1 and rank != print_rank:
        return
    acc = _accelerator()
    acc.synchronize()
    if reset_max:
        acc._reset_peak()
    alloc, reserved = acc.memory_allocated(), acc.memory_reserved()
    d_alloc, d_reserved = alloc - _last_status["allocated"], reserved - _last_status["reserved"]
    _last_status.update(allocated=alloc, reserved=reserved)
    print(f"RANK={rank} MEMSTATS {msg} device={acc.current_device_name()} "
          f"current alloc={alloc / _GIB:0.4f}GB (delta={d_alloc / _GIB:0.4f}GB "
          f"max={acc.max_memory_allocated() / _GIB:0.4f}GB) current cache={reserved / _GIB:0.4f}GB "
          f"(delta={d_reserved / _GIB:0.4f}GB max={acc.max_memory_reserved() / _GIB:0.4f}GB)")


def get_ma_status() -> int:
    """Bytes allocated on the device, on rank 0 (0 elsewhere)."""
    return _accelerator().memory_allocated() if _rank() == 0 else 0


def empty_cache() -> None:
    """Release the device's cached memory and reset its peak counters."""
    acc = _accelerator()
    acc.empty_cache()
    acc._reset_peak()


def is_model_parallel_parameter(p: torch.Tensor) -> bool:
    """True for a parameter sliced over model/tensor-parallel ranks (Megatron's marks)."""
    return bool(getattr(p, "model_parallel", False) or getattr(p, "tensor_model_parallel", False))


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of norms: ``sqrt(sum(n ** 2))``."""
    return math.sqrt(sum(float(n) ** 2.0 for n in norm_list))


def _mp_group(mpu: Any) -> Any:
    return mpu.get_model_parallel_group() if mpu is not None else None


def _local_norm(tensors: Sequence[torch.Tensor], norm_type: float, mpu: Any,
                counted: Callable[[torch.Tensor], bool]) -> torch.Tensor:
    """The ``norm_type`` norm over ``tensors`` on this rank and its model-parallel group (float32)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if norm_type == math.inf:
        local = max((t.detach().abs().max().float() for t in tensors), default=torch.zeros((), device=device))
        total = local.reshape(1).clone()
        if mpu is not None and _dist_ready():
            torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX, group=_mp_group(mpu))
        return total[0]
    parts = [t.detach().float().norm(norm_type) ** norm_type for t in tensors if counted(t)]
    total = (torch.stack(parts).sum() if parts else torch.zeros((), device=device)).reshape(1)
    if mpu is not None and _dist_ready():
        torch.distributed.all_reduce(total, group=_mp_group(mpu))
    return total[0] ** (1.0 / norm_type)


def _counted_once(mpu: Any) -> Callable[[torch.Tensor], bool]:
    """With model parallelism, a replicated tensor counts on model-parallel rank 0 only."""
    if mpu is None:
        return lambda t: True
    first = mpu.get_model_parallel_rank() == 0
    return lambda t: first or is_model_parallel_parameter(t)


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2, mpu: Any = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` in place so their total norm is at most ``max_norm``.

    The norm covers the model-parallel group (``mpu``) and is averaged over the data-parallel
    group, as DeepSpeed's (ranks' gradients are equal after the reduction, so the average is the
    norm). Returns the total norm (a one-element tensor), before clipping.

    Collective when torch.distributed is initialised: call on every rank of the data-parallel group.
    """
    from dslaunch.runtime.parallel import deepspeed_groups as groups

    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if p.grad is not None]
    norm_type = float(norm_type)
    # the parameter of each gradient decides whether it counts (model-parallel slices)
    counted = _counted_once(mpu)
    grads = [p.grad for p in params if norm_type == math.inf or counted(p)]
    total = _local_norm(grads, norm_type, mpu, lambda t: True).reshape(1)
    if _dist_ready():
        group = groups.get_data_parallel_group()
        total = total / torch.distributed.get_world_size(group=group)
        torch.distributed.all_reduce(total, group=group)
    if params:
        total = total.to(params[0].device)
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return total


def get_grad_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The total norm of the gradients of ``parameters`` (model-parallel aware); -1 when not finite."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    counted = _counted_once(mpu)
    grads = [p.grad for p in params if p.grad is not None and (float(norm_type) == math.inf or counted(p))]
    return _finite_or_minus_one(_local_norm(grads, float(norm_type), mpu, lambda t: True))


def get_weight_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
    """The total norm of ``parameters`` themselves (model-parallel aware); -1 when not finite.

    A parameter the pipeline replicates across stages (``ds_pipe_replicated``) counts once.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    params = [p for p in params if not getattr(p, "ds_pipe_replicated", False)]
    return _finite_or_minus_one(_local_norm(params, float(norm_type), mpu, _counted_once(mpu)))


def _finite_or_minus_one(norm: torch.Tensor) -> float:
    value = float(norm)
    return value if math.isfinite(value) else -1.0


def has_inf_or_nan(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds an inf or a NaN: a bool scalar tensor on ``x``'s device (no host sync).
    Two reductions (``amax`` shows NaN and +inf, ``amin`` -inf), no elementwise mask."""
    if x.is_sparse:  # only the stored entries can be non-finite
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return ~(torch.isfinite(x.amax()) & torch.isfinite(x.amin()))


def grads_overflow(params: Iterable[torch.Tensor]) -> bool:
    """Whether any ``.grad`` of ``params`` holds an inf or a NaN, on this rank (DeepSpeed's
    ``has_overflow_serial``, which its loss scaler and ``CheckOverflow`` both carry)."""
    return any(p.grad is not None and bool(has_inf_or_nan(p.grad.data)) for p in params)


def is_invalid_grad_norm(norm: Any) -> bool:
    """A norm that says the gradients overflowed: not finite, or negative (the -1 DeepSpeed's norms
    stand for inf/NaN with)."""
    if torch.is_tensor(norm):
        return bool((~torch.isfinite(norm) | (norm < 0)).any())
    return not math.isfinite(float(norm)) or norm < 0


class CheckOverflow:
    """DeepSpeed's gradient overflow check across ranks, for a script's own fp16 loop.

    Args:
        param_groups: lists of parameters whose ``.grad`` ``check()`` inspects (None: pass them to
            ``check``). An expert parameter among them (``allreduce`` False) makes every check
            all-reduce over the largest expert-parallel group, so one expert's inf is seen by all.
        mpu: the model-parallel unit: its group is all-reduced over (and its data group where the
            ``deepspeed`` engine does not all-reduce gradients itself).
        zero_reduce_scatter: all-reduce ``has_overflow`` over every rank.
        deepspeed: the engine (``enable_backward_allreduce`` off: all-reduce over every rank).

    collective: where an all-reduce applies (above), every rank of that group must call.
    """

    def __init__(self, param_groups: Any = None, mpu: Any = None, zero_reduce_scatter: bool = False,
                 deepspeed: Any = None):
        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = _any_moe(self.params or [])

    def check_using_norm(self, norm_group: Iterable[Any], reduce_overflow: bool = True) -> bool:
        """Whether any of the norms is invalid (``is_invalid_grad_norm``), over the expert group
        (expert parameters), the model-parallel group (``mpu``), else every rank (``reduce_overflow``)."""
        flag = torch.tensor([float(any(is_invalid_grad_norm(n) for n in norm_group))],
                            device=_accelerator().current_device_name())
        groups = [_max_expert_group()] if self.has_moe_params else []
        if self.mpu is not None:
            groups.append(self.mpu.get_model_parallel_group())
        elif reduce_overflow:
            groups.append(None)
        return _any_rank(flag, groups)

    def check(self, param_groups: Any = None) -> bool:
        """``has_overflow`` of ``param_groups`` (None: those given at construction)."""
        if param_groups is None:
            return self.has_overflow(self.params, self.has_moe_params)
        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, _any_moe(params))

    def has_overflow_serial(self, params: Iterable[torch.Tensor]) -> bool:
        """``grads_overflow``: whether any ``.grad`` of ``params`` holds an inf or a NaN, on this rank."""
        return grads_overflow(params)

    def has_overflow(self, params: Iterable[torch.Tensor], has_moe_params: bool | None = None) -> bool:
        """``has_overflow_serial`` over the ranks that must agree (see the class docstring)."""
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        flag = torch.tensor([float(self.has_overflow_serial(params))], device=_accelerator().current_device_name())
        groups = [_max_expert_group()] if moe else []
        engine_reduces = self._engine_reduces()
        if self.zero_reduce_scatter:
            groups.append(None)
        elif self.mpu is not None:
            if not engine_reduces:
                groups.append(self.mpu.get_data_parallel_group())
            groups.append(self.mpu.get_model_parallel_group())
        elif not engine_reduces:
            groups.append(None)
        return _any_rank(flag, groups)

    def _engine_reduces(self) -> bool:
        """The engine all-reduces the gradients itself (True without one)."""
        if self.deepspeed is None:
            return True
        if hasattr(self.deepspeed, "pipeline_enable_backward_allreduce"):
            return self.deepspeed.pipeline_enable_backward_allreduce is not False
        return self.deepspeed.enable_backward_allreduce is not False


def _any_moe(params: Iterable[torch.Tensor]) -> bool:
    from dslaunch.runtime.moe.utils import is_moe_param

    return any(is_moe_param(p) for p in params)


def _max_expert_group() -> Any:
    from dslaunch.runtime.parallel import deepspeed_groups as groups

    return groups._get_max_expert_parallel_group()


def _any_rank(flag: torch.Tensor, groups: list[Any]) -> bool:
    """``flag`` MAX-all-reduced over each group in turn (None: every rank); whether it is set."""
    for group in groups:
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(flag[0].item())


def get_grad_zeros(parameters: Any, mpu: Any = None) -> float:
    """How many gradient entries are exactly zero (summed over the model-parallel group)."""
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    counted = _counted_once(mpu)
    zeros = sum(int((p.grad == 0).sum()) for p in params if p.grad is not None and counted(p))
    total = torch.tensor([float(zeros)])
    if mpu is not None and _dist_ready():
        torch.distributed.all_reduce(total, group=_mp_group(mpu))
    return float(total[0])


def prefix_sum_inc(weights: Iterable[int]) -> list[int]:
    """Inclusive prefix sums: ``[3, 4, 5]`` -> ``[3, 7, 12]``."""
    out: list[int] = []
    for w in weights:
        out.append(w + (out[-1] if out else 0))
    return out


def move_to_device(item: Any, device: Any, criterion_func: Callable[[Any], bool] | None = None) -> Any:
    """``item`` with every tensor (in lists, tuples and dicts, recursively) on ``device``.

    A tensor ``criterion_func`` accepts is moved in place (its ``.data`` replaced: the same object
    comes back, as DeepSpeed does for parameters); any other tensor is copied with ``.to(device)``.
    Values that are neither tensors nor containers come back as they are.
    """
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, (list, tuple)):  # a tuple of any kind comes back a plain tuple, as DeepSpeed's
        moved = [move_to_device(x, device, criterion_func) for x in item]
        return moved if isinstance(item, list) else tuple(moved)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item.to(device) if isinstance(item, torch.Tensor) else item


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """``"base(1, 'a', key=2)"``: how a call looks, for logs."""
    return f"{base}({', '.join([*map(repr, args), *(f'{k}={v!r}' for k, v in kwargs.items())])})"


def get_only_unique_item(items: Iterable[Any]) -> Any:
    """The one distinct value of ``items``; RuntimeError when there are none or several."""
    distinct = set(items)
    if len(distinct) != 1:
        raise RuntimeError(f"expected there to be only one unique element in {items}")
    return next(iter(distinct))


def noop_decorator(func: Callable) -> Callable:
    return func


class noop_context:  # noqa: N801 (DeepSpeed's name)
    """A context manager that does nothing (``with noop_context():``)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold ``filename`` (and its parents) if missing, by
    ``safe_write``'s rule (no foreign link followed, no directory another user can write)."""
    make_dirs(Path(filename).parent)


class DummyOptim:
    """A stand-in optimizer holding ``params`` in one param group (DeepSpeed uses it for ZeRO-3
    without an optimizer); it has no ``step``."""

    def __init__(self, params: Iterable[torch.Tensor]):
        self.param_groups = [{"params": list(params)}]
        self.state: dict = {}
