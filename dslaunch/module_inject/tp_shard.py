"""``deepspeed.module_inject.tp_shard``: how AutoTP splits a dimension over the tensor-parallel
ranks (``dslaunch.runtime.tensor_parallel.split``). ``get_shard_size_list(total, tp, meta, name)``
is 0.19.8's form; 0.19.6's ``(total, tp, name)`` is read too."""

from dslaunch.runtime.tensor_parallel.split import AutoTPMeta, get_shard_size, get_shard_size_list

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]
