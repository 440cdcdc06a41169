"""``dslaunch.comm`` (DeepSpeed's ``deepspeed.comm``): collectives and process-group queries.

Thin over ``torch.distributed``: the same functions with DeepSpeed's extra keyword arguments
(``prof``, ``log_name``, ``debug``: DeepSpeed's comms logger, which dslaunch does not have) accepted
and ignored. ``init_distributed`` is the engine's (``dslaunch.runtime.dist``): gloo without GPUs,
nccl with them, the timeout always explicit.

Every collective runs marked as a wait on the peers (``runtime.heartbeat.waiting``): on a hang, a
rank in one of them is not the rank the others wait for.

Unlike DeepSpeed, the queries work whenever ``torch.distributed`` is initialised, also by the
script itself (DeepSpeed asserts unless its own ``init_distributed`` ran); before that,
``get_rank``/``get_world_size`` raise ``UsageError`` naming the call to make.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch.distributed as _dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from dslaunch.errors import UsageError
from dslaunch.runtime.dist import init_distributed
from dslaunch.runtime.heartbeat import waiting

__all__ = [
    "ReduceOp", "ProcessGroup", "Work", "init_distributed", "is_initialized", "is_available",
    "destroy_process_group", "get_rank", "get_world_size", "get_local_rank", "get_global_rank",
    "get_world_group", "get_backend", "new_group", "barrier", "monitored_barrier", "all_reduce",
    "inference_all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_fn", "gather", "scatter", "all_to_all_single", "send", "recv", "isend", "irecv",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "get_all_ranks_from_group",
]

_PROFILING_KWARGS = ("prof", "log_name", "debug")


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` taking (and dropping) DeepSpeed's comms-logger keyword arguments, marked as a wait."""
    name = fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        for key in _PROFILING_KWARGS:
            kwargs.pop(key, None)
        with waiting(name):
            return fn(*args, **kwargs)

    return call


is_initialized = _dist.is_initialized
is_available = _dist.is_available
destroy_process_group = _dist.destroy_process_group
new_group = _dist.new_group
get_global_rank = _dist.get_global_rank
get_backend = _dist.get_backend

barrier = _collective(_dist.barrier)
monitored_barrier = _collective(_dist.monitored_barrier)
all_reduce = _collective(_dist.all_reduce)
inference_all_reduce = all_reduce  # DeepSpeed's fast path for inference; the same result
reduce = _collective(_dist.reduce)
broadcast = _collective(_dist.broadcast)
all_gather = _collective(_dist.all_gather)
all_gather_into_tensor = _collective(_dist.all_gather_into_tensor)
reduce_scatter = _collective(_dist.reduce_scatter)
reduce_scatter_tensor = _collective(_dist.reduce_scatter_tensor)
gather = _collective(_dist.gather)
scatter = _collective(_dist.scatter)
all_to_all_single = _collective(_dist.all_to_all_single)
send = _collective(_dist.send)
recv = _collective(_dist.recv)
isend = _collective(_dist.isend)
irecv = _collective(_dist.irecv)


def _require_init(call: str) -> None:
    if not _dist.is_initialized():
        raise UsageError(f"deepspeed.comm.{call}(): torch.distributed is not initialized; call "
                         "deepspeed.init_distributed() (or deepspeed.initialize()) first")


def get_rank(group: ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: the world)."""
    _require_init("get_rank")
    return _dist.get_rank(group)


def get_world_size(group: ProcessGroup | None = None) -> int:
    """The number of ranks in ``group`` (default: the world)."""
    _require_init("get_world_size")
    return _dist.get_world_size(group)


def get_local_rank() -> int:
    """The rank on this node, from ``LOCAL_RANK`` (0 when unset), as DeepSpeed reads it."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_world_group() -> ProcessGroup:
    _require_init("get_world_group")
    return _dist.group.WORLD


def get_all_ranks_from_group(group: ProcessGroup | None = None) -> list[int]:
    """The global ranks of ``group``'s members, in group-rank order."""
    _require_init("get_all_ranks_from_group")
    return _dist.get_process_group_ranks(group or _dist.group.WORLD)


def all_reduce_coalesced(tensors: list[Any], op: ReduceOp = ReduceOp.SUM, group: ProcessGroup | None = None,
                         async_op: bool = False, **kwargs: Any) -> Any:
    """All-reduce each tensor of ``tensors`` in place (one collective per tensor).

    collective: call on all ranks with tensors of the same shapes.
    """
    works = [all_reduce(t, op=op, group=group, async_op=async_op, **kwargs) for t in tensors]
    return works if async_op else None


def allgather_fn(output_tensor: Any, input_tensor: Any, group: ProcessGroup | None = None,
                 async_op: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's name for ``all_gather_into_tensor``."""
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor: Any, tensor: Any, op: ReduceOp = ReduceOp.SUM,
                      group: ProcessGroup | None = None, async_op: bool = False, debug: Any = None) -> Any:
    """DeepSpeed's name for ``reduce_scatter_tensor``."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True
