"""``deepspeed.checkpoint.reshape_meg_2d``: the (pipeline, tensor) file map and its reshaping
(``dslaunch.runtime.checkpoint.deepspeed_reshape``)."""

from dslaunch.runtime.checkpoint.deepspeed_reshape import meg_2d_parallel_map, reshape_meg_2d_parallel

__all__ = ["meg_2d_parallel_map", "reshape_meg_2d_parallel"]
