"""DeepSpeed's ``deepspeed.utils.groups``: this rank's data- and model-parallel groups.

They come from ``mpu``, the grid of the last engine built (``initialize(mpu=...)``, or a
``pipe.topology.PipelineParallelGrid``), as DeepSpeed's module reads its ``mpu`` global; without
one every rank is a data-parallel peer in the world group (DeepSpeed returns a clone of the world
group; the world itself here: the same ranks, one communicator less), model and tensor sizes are
1 and their ranks 0, and asking for their group raises ``KeyError`` as DeepSpeed does when no such
group was set up. Sequence and expert axes come from the grid's ``runtime.parallel`` groups (a
dslaunch grid: ``sequence_parallel_size`` in the config, or the mpu ``UlyssesSPAttentionHF``
returns); without them their sizes are 1, the sequence and expert groups raise ``KeyError``, the
sequence-data group is the data-parallel group and the expert-data group too (DeepSpeed's answers
without sequence or expert parallelism). The tensor group is looked up in the one order of
``runtime.parallel.mpu``.
"""

from __future__ import annotations

from typing import Any

from dslaunch.runtime.parallel.mpu import tensor_axis

__all__ = [
    "get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
    "get_model_parallel_group", "get_model_parallel_world_size", "get_model_parallel_rank",
    "get_tensor_model_parallel_group", "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
]

mpu: Any = None
"""The grid of the last engine built with model parallelism (DeepSpeed's ``groups.mpu``); the
engine sets it, None for a data-parallel-only job."""


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        from dslaunch.errors import UsageError

        raise UsageError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                         "deepspeed.init_distributed() (or deepspeed.initialize()) first")
    return dist


def _get_data_parallel_group() -> Any:
    dist = _dist()
    group = mpu.get_data_parallel_group() if mpu is not None else None
    return dist.group.WORLD if group is None else group


def _get_data_parallel_world_size() -> int:
    return mpu.get_data_parallel_world_size() if mpu is not None else _dist().get_world_size()


def _get_data_parallel_rank() -> int:
    return mpu.get_data_parallel_rank() if mpu is not None else _dist().get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    dist = _dist()
    return dist.get_process_group_ranks(_get_data_parallel_group())


def _get_broadcast_src_rank() -> int:
    """The global rank of data-parallel rank 0 of this rank's group (DeepSpeed's broadcast source)."""
    return _get_data_parallel_group_ranks()[0]


def _model(what: str, tensor: bool = False) -> Any:
    """``mpu``'s model-parallel (or tensor-slice) answer; the no-model-parallel answer without one."""
    if mpu is None:
        _dist()
        if what == "group":
            raise KeyError(f"No {'tensor' if tensor else 'model'} parallel group found (no mpu: this job "
                           "runs data parallel only)")
        return 1 if what == "world_size" else 0
    return tensor_axis(mpu, what) if tensor else getattr(mpu, f"get_model_parallel_{what}")()


def get_model_parallel_group() -> Any:
    return _model("group")


def get_model_parallel_world_size() -> int:
    return _model("world_size")


def get_model_parallel_rank() -> int:
    return _model("rank")


def get_tensor_model_parallel_group() -> Any:
    return _model("group", tensor=True)


def get_tensor_model_parallel_world_size() -> int:
    return _model("world_size", tensor=True)


def get_tensor_model_parallel_rank() -> int:
    return _model("rank", tensor=True)


def _axis(role: str) -> tuple[int, int]:
    """(size, my index) of my group of ``role`` on the grid's axes; (1, 0) for a grid without them."""
    grid_groups = getattr(mpu, "groups", None)
    if grid_groups is None or not grid_groups.axes(role):  # (answers without torch.distributed too)
        return 1, 0
    return grid_groups.size(role), grid_groups.rank_in(role)


def _axis_group(role: str, kind: str) -> Any:
    if _axis(role)[0] == 1:
        raise KeyError(f"No {kind} parallel group found (this job has no {kind} parallelism)")
    return mpu.groups.group(role)


def _get_sequence_parallel_world_size() -> int:
    return _axis("sequence")[0]


def _get_sequence_parallel_rank() -> int:
    return _axis("sequence")[1]


def _get_sequence_parallel_group() -> Any:
    return _axis_group("sequence", "sequence")


def _sequence_data(what: str) -> Any:
    """The grid's data x sequence answer (where gradients average); the data-parallel one without."""
    get = getattr(mpu, f"get_sequence_data_parallel_{what}", None)
    if callable(get):
        _dist()
        return get()
    return {"group": _get_data_parallel_group, "rank": _get_data_parallel_rank,
            "world_size": _get_data_parallel_world_size}[what]()


def _get_sequence_data_parallel_group() -> Any:
    return _sequence_data("group")


def _get_sequence_data_parallel_world_size() -> int:
    return _sequence_data("world_size")


def _get_sequence_data_parallel_rank() -> int:
    return _sequence_data("rank")


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    return _axis("expert")[0]


def _get_expert_parallel_rank(group_name: str | None = None) -> int:
    return _axis("expert")[1]


def _get_expert_parallel_group(group_name: str | None = None) -> Any:
    return _axis_group("expert", "expert")


def _get_expert_data_parallel_world_size(group_name: str | None = None) -> int:
    return _get_data_parallel_world_size() // _get_expert_parallel_world_size()


def _get_expert_data_parallel_rank(group_name: str | None = None) -> int:
    return _get_data_parallel_rank() // _get_expert_parallel_world_size()


def _get_expert_data_parallel_group(group_name: str | None = None) -> Any:
    """The data ranks that hold the same experts: the data-parallel group without expert parallelism."""
    return mpu.groups.group("expert_data") if _axis("expert")[0] > 1 else _get_data_parallel_group()


_get_model_parallel_world_size = get_model_parallel_world_size
_get_model_parallel_rank = get_model_parallel_rank
_get_model_parallel_group = get_model_parallel_group
_get_expert_model_parallel_world_size = _get_expert_parallel_world_size

get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
