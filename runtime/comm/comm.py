"""DeepSpeed's ``deepspeed.comm`` (re-exported as ``dslaunch.comm``): collectives and process-group
queries.

Thin over ``torch.distributed``: the same functions with DeepSpeed's extra keyword arguments
(``prof``, ``log_name``, ``debug``) for the comms logger (``comms_logger`` in the ds_config, or
``configure(enabled=True)``): while it is on, every collective called here (the ZeRO stages' own
too) is timed to its completion and counted (``comms_logging``), and
``log_summary()`` prints DeepSpeed's table; while it is off a call costs one attribute check more
than ``torch.distributed``'s (scripts/bench/monitor_bench.py). ``init_distributed`` is the engine's (``dslaunch.runtime.dist``): gloo without GPUs,
nccl with them, the timeout always explicit.

Every collective runs marked as a wait on the peers (``runtime.heartbeat.waiting``): on a hang, a
rank in one of them is not the rank the others wait for.

Unlike DeepSpeed, the queries work whenever ``torch.distributed`` is initialised, also by the
script itself (DeepSpeed asserts unless its own ``init_distributed`` ran); before that,
``get_rank``/``get_world_size`` raise ``UsageError`` naming the call to make.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as _dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from dslaunch.errors import UsageError
from dslaunch.runtime.comm.comms_logging import CommsLogger, message_size
from dslaunch.runtime.dist import init_distributed, mpi_discovery
from dslaunch.runtime.heartbeat import waiting

__all__ = [
    "ReduceOp", "ProcessGroup", "Work", "init_distributed", "is_initialized", "is_available",
    "destroy_process_group", "get_rank", "get_world_size", "get_local_rank", "get_global_rank",
    "get_world_group", "get_backend", "new_group", "barrier", "monitored_barrier", "all_reduce",
    "inference_all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather",
    "all_gather_into_tensor", "allgather_fn", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_fn", "gather", "scatter", "all_to_all_single", "send", "recv", "isend", "irecv",
    "has_all_gather_into_tensor", "has_reduce_scatter_tensor", "get_all_ranks_from_group",
    "comms_logger", "configure", "log_summary", "start_profiling_comms", "stop_profiling_comms",
    "start_profiling_op", "stop_profiling_op", "mpi_discovery",
    "all_to_all", "broadcast_object_list", "all_gather_object", "batch_isend_irecv", "P2POp", "all_gather_coalesced",
    "has_all_reduce_coalesced", "has_coalescing_manager", "reset_log", "has_comm_data", "get_comm_operation_count",
    "get_logged_comm_ops", "in_aml", "in_aws_sm", "in_dlts",
]

_PROFILING_KWARGS = ("prof", "log_name", "debug")

# One per process, as DeepSpeed's: log_summary() and configure() are module functions that name no
# engine, and every engine and the user's own calls feed the same table.
comms_logger = CommsLogger()


def _collective(fn: Callable[..., Any], name: str | None = None) -> Callable[..., Any]:
    """``fn`` taking DeepSpeed's comms-logger keyword arguments, marked as a wait on the peers;
    timed while the logger is on. ``name``: its name in the logger and the hang report (default:
    ``fn``'s own)."""
    op = name or fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if comms_logger.enabled:
            with waiting(op):
                return _timed(op, fn, args, kwargs)
        for key in _PROFILING_KWARGS:
            kwargs.pop(key, None)
        with waiting(op):
            return fn(*args, **kwargs)

    call.__name__ = call.__qualname__ = op
    return call


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _sync_cuda_if_in_use() -> None:
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _timed(op: str, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``fn`` and record it: at return, or for an asynchronous one when its future completes."""
    prof, log_name = kwargs.pop("prof", False), kwargs.pop("log_name", None) or op
    kwargs.pop("debug", None)
    if not comms_logger.wants(op, bool(prof)):
        return fn(*args, **kwargs)
    if comms_logger.debug:  # DeepSpeed's form: which function issued it
        log_name = f"{log_name} | [Caller Func: {sys._getframe(2).f_code.co_name}]"
    arguments = _signature(fn).bind_partial(*args, **kwargs).arguments
    size = message_size(op, arguments)
    group = arguments.get("group")
    n, rank = _dist.get_world_size(group), _dist.get_rank()
    start = time.perf_counter()
    result = fn(*args, **kwargs)

    def done(_: Any = None) -> None:
        comms_logger.append(op, log_name, (time.perf_counter() - start) * 1000.0, size, n, rank)

    try:
        future = result.get_future() if result is not None and hasattr(result, "get_future") else None
    except RuntimeError:  # gloo's point-to-point Work (isend/irecv) has no future: time the launch
        future = None
    if future is not None:
        future.add_done_callback(done)
    else:
        _sync_cuda_if_in_use()
        done()
    return result


is_initialized = _dist.is_initialized
is_available = _dist.is_available
destroy_process_group = _dist.destroy_process_group
new_group = _dist.new_group
get_global_rank = _dist.get_global_rank
get_backend = _dist.get_backend

barrier = _collective(_dist.barrier)
monitored_barrier = _collective(_dist.monitored_barrier)
all_reduce = _collective(_dist.all_reduce)
# DeepSpeed's name for the all-reduce of tensor-parallel inference: the same result, its own row in
# the comms logger (dslaunch.inference uses it when its shared-memory all-reduce does not apply).
inference_all_reduce = _collective(_dist.all_reduce, "inference_all_reduce")
reduce = _collective(_dist.reduce)
broadcast = _collective(_dist.broadcast)
all_gather = _collective(_dist.all_gather)
# torch 2.13 renamed these two (the old names raise a FutureWarning in every process that calls them);
# the functions are the same, DeepSpeed's names stay ours and the comms logger's
all_gather_into_tensor = _collective(getattr(_dist, "all_gather_single", _dist.all_gather_into_tensor),
                                     "all_gather_into_tensor")
reduce_scatter = _collective(_dist.reduce_scatter)
reduce_scatter_tensor = _collective(getattr(_dist, "reduce_scatter_single", _dist.reduce_scatter_tensor),
                                    "reduce_scatter_tensor")
gather = _collective(_dist.gather)
scatter = _collective(_dist.scatter)
all_to_all_single = _collective(_dist.all_to_all_single)
all_to_all = _collective(_dist.all_to_all)
broadcast_object_list = _collective(_dist.broadcast_object_list)
all_gather_object = _collective(_dist.all_gather_object)
batch_isend_irecv = _collective(_dist.batch_isend_irecv)
P2POp = _dist.P2POp
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


def all_gather_coalesced(output_tensors: list[Any], input_tensors: list[Any], group: ProcessGroup | None = None,
                         async_op: bool = False) -> Any:
    """``all_gather_into_tensor`` of each input into its output, in order (DeepSpeed's name; one
    collective per pair). Returns the last one's work with ``async_op``.

    collective: call on all ranks with inputs of the same shapes.
    """
    if len(output_tensors) != len(input_tensors):
        raise ValueError(f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs")
    works = [all_gather_into_tensor(out, inp, group=group, async_op=async_op)
             for out, inp in zip(output_tensors, input_tensors, strict=True)]
    return works[-1] if async_op and works else None


def has_all_gather_into_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    """False: ``all_gather_coalesced`` and ``all_reduce_coalesced`` issue one collective per tensor."""
    return False


def has_reduce_scatter_tensor() -> bool:
    return True


def configure(deepspeed_config: Any = None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """Set up the comms logger, as DeepSpeed's: from a config (a ``DeepSpeedConfig``, or its
    ``comms_logger`` block), then each argument given overrides its key.

    Raises:
        ConfigError: a bad ``prof_ops`` name (the operations are ``runtime.config.comms_logger.OPS``).
    """
    from dslaunch.runtime.config.comms_logger import _ops

    if deepspeed_config is not None:
        comms_logger.configure(getattr(deepspeed_config, "comms_logger", deepspeed_config))
    for key, value in (("enabled", enabled), ("prof_all", prof_all), ("verbose", verbose), ("debug", debug)):
        if value is not None:
            setattr(comms_logger, key, bool(value))
    if prof_ops is not None:
        comms_logger.prof_ops = list(_ops("prof_ops", prof_ops))


def reset_log() -> None:
    """Forget what the comms logger recorded (per-epoch tables: ``log_summary`` then ``reset_log``)."""
    comms_logger.reset()


def has_comm_data() -> bool:
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    """How many collectives the comms logger recorded, all kinds together."""
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """The names of the collectives the comms logger recorded (``all_reduce``, ...)."""
    return comms_logger.get_operation_names()


def in_aml() -> bool:
    """Running in Azure Machine Learning (``AZUREML_EXPERIMENT_ID`` set), as DeepSpeed tells."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Running in AWS SageMaker (``SM_TRAINING_ENV`` set)."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Running under Microsoft's DLTS (``DLTS_JOB_ID`` set)."""
    return "DLTS_JOB_ID" in os.environ


def start_profiling_comms() -> None:
    comms_logger.start_profiling_comms()


def stop_profiling_comms() -> None:
    comms_logger.stop_profiling_comms()


def start_profiling_op(op_name_list: list[str]) -> None:
    comms_logger.start_profiling_op(op_name_list)


def stop_profiling_op(op_name_list: list[str]) -> None:
    comms_logger.stop_profiling_op(op_name_list)


def _stragglers(latencies: dict[tuple[str, int], list[float]]) -> dict[tuple[str, int], float | None]:
    """For each row any rank has: this rank's total latency minus the fastest rank's, op by op
    (None where ranks counted a different number of operations: a point-to-point row).

    collective: every rank, with its own records.
    """
    import torch

    keys: list[Any] = [None] * _dist.get_world_size()
    _dist.all_gather_object(keys, sorted(latencies))
    out: dict[tuple[str, int], float | None] = {}
    for key in sorted({tuple(k) for ks in keys for k in ks}):
        mine = latencies.get(key, [])
        counts = torch.tensor([len(mine), -len(mine)], dtype=torch.float64)
        _dist.all_reduce(counts, op=ReduceOp.MAX)
        if counts[0] != -counts[1]:
            out[key] = None
            continue
        lat = torch.tensor(mine, dtype=torch.float64)
        fastest = lat.clone()
        _dist.all_reduce(fastest, op=ReduceOp.MIN)
        out[key] = float((lat - fastest).sum())
    return out


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> dict | None:
    """Rank 0 prints the comms logger's table: per operation and message size, the count, total and
    mean latency (ms) and the mean algorithmic and bus bandwidth (Gbps); with ``show_straggler``,
    how much longer each row took on rank 0 than on the fastest rank, op by op. The summary's own
    collectives are not counted.

    collective: call on all ranks.

    Returns:
        With ``return_dict``, the table as ``{name: {size: {count, total_latency, avg_latency,
        algbw, busbw[, straggler]}}}`` (this rank's records); else None.
    """
    _require_init("log_summary")
    _dist.barrier()  # after every rank's operations so far (gloo runs a group's ops in order)
    summary = comms_logger.summary()
    if show_straggler:
        for (name, size), value in _stragglers(comms_logger.latencies()).items():
            if name in summary and size in summary[name]:
                summary[name][size]["straggler"] = value
    if _dist.get_rank() == 0:
        comms_logger.log_all(summary)
    return summary if return_dict else None
