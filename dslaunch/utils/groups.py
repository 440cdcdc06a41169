"""DeepSpeed's ``deepspeed.utils.groups`` for dslaunch's one kind of parallelism: data parallel.

Every rank is in one data-parallel group, the world (DeepSpeed returns a clone of the world
group; the world itself here: the same ranks, one communicator less). Model, tensor, sequence
and expert parallelism do not exist in dslaunch: their sizes are 1 and their ranks 0, and asking
for their group raises ``KeyError`` as DeepSpeed does when no such group was set up.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "get_data_parallel_group", "get_data_parallel_world_size", "get_data_parallel_rank",
    "get_model_parallel_world_size", "get_model_parallel_rank",
    "get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank",
]


def _dist() -> Any:
    import torch.distributed as dist

    if not dist.is_initialized():
        from dslaunch.errors import UsageError

        raise UsageError("deepspeed.utils.groups: torch.distributed is not initialized; call "
                         "deepspeed.init_distributed() (or deepspeed.initialize()) first")
    return dist


def _get_data_parallel_group() -> Any:
    return _dist().group.WORLD


def _get_data_parallel_world_size() -> int:
    return _dist().get_world_size()


def _get_data_parallel_rank() -> int:
    return _dist().get_rank()


def _get_data_parallel_group_ranks() -> list[int]:
    return list(range(_get_data_parallel_world_size()))


def _get_broadcast_src_rank() -> int:
    return 0


def _one() -> int:
    return 1


def _zero() -> int:
    return 0


def _no_group(kind: str) -> Any:
    def get() -> Any:
        raise KeyError(f"No {kind} parallel group found (dslaunch runs data parallel only)")

    get.__name__ = f"_get_{kind}_parallel_group"
    return get


_get_model_parallel_world_size = _get_sequence_parallel_world_size = _one
_get_expert_model_parallel_world_size = _one
_get_sequence_parallel_rank = _zero
_get_sequence_parallel_group = _no_group("sequence")
_get_sequence_data_parallel_world_size = _get_data_parallel_world_size
_get_sequence_data_parallel_rank = _get_data_parallel_rank
_get_sequence_data_parallel_group = _get_data_parallel_group

get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size = _one
get_model_parallel_rank = get_tensor_model_parallel_rank = _zero
get_model_parallel_group = get_tensor_model_parallel_group = _no_group("model")
