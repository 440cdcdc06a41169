"""DeepSpeed's ``deepspeed.utils.groups``: this rank's data- and model-parallel groups.

They come from ``mpu``, the grid of the last engine built (``initialize(mpu=...)``, or a
``pipe.topology.PipelineParallelGrid``), as DeepSpeed's module reads its ``mpu`` global; without
one every rank is a data-parallel peer in the world group (DeepSpeed returns a clone of the world
group; the world itself here: the same ranks, one communicator less), model and tensor sizes are
1 and their ranks 0, and asking for their group raises ``KeyError`` as DeepSpeed does when no such
group was set up. Sequence and expert parallelism do not exist in dslaunch (sizes 1).
"""

from __future__ import annotations

from typing import Any

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
    for name in ((f"get_tensor_model_parallel_{what}", f"get_slice_parallel_{what}") if tensor else ()):
        if callable(getattr(mpu, name, None)):
            return getattr(mpu, name)()
    return getattr(mpu, f"get_model_parallel_{what}")()


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


def _one() -> int:
    return 1


def _zero() -> int:
    return 0


def _no_group(kind: str) -> Any:
    def get() -> Any:
        raise KeyError(f"No {kind} parallel group found (dslaunch has no {kind} parallelism)")

    get.__name__ = f"_get_{kind}_parallel_group"
    return get


_get_model_parallel_world_size = get_model_parallel_world_size
_get_model_parallel_rank = get_model_parallel_rank
_get_model_parallel_group = get_model_parallel_group
_get_sequence_parallel_world_size = _get_expert_model_parallel_world_size = _one
_get_sequence_parallel_rank = _zero
_get_sequence_parallel_group = _no_group("sequence")
_get_sequence_data_parallel_world_size = _get_data_parallel_world_size
_get_sequence_data_parallel_rank = _get_data_parallel_rank
_get_sequence_data_parallel_group = _get_data_parallel_group

get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
