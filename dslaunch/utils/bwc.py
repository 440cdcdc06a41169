"""``deepspeed.utils.bwc``: an mpu's tensor- and pipeline-parallel rank, size and group under
whichever names it answers (Megatron's ``get_tensor_model_parallel_*``, DeepSpeed's pipeline grid
``get_slice_parallel_*``, older ``get_model_parallel_*``); ``runtime/parallel/mpu.py``, dslaunch's
one lookup of an mpu's tensor axis."""

from dslaunch.runtime.parallel.mpu import (
    bwc_pipeline_parallel_group,
    bwc_pipeline_parallel_world_size,
    bwc_tensor_model_parallel_group,
    bwc_tensor_model_parallel_rank,
    bwc_tensor_model_parallel_world_size,
)

__all__ = ["bwc_tensor_model_parallel_rank", "bwc_tensor_model_parallel_world_size",
           "bwc_tensor_model_parallel_group", "bwc_pipeline_parallel_world_size", "bwc_pipeline_parallel_group"]
