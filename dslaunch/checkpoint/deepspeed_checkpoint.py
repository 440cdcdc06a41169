"""``deepspeed.checkpoint.deepspeed_checkpoint``: ``DeepSpeedCheckpoint`` and the layer-naming
constants Megatron-DeepSpeed's conversion tools import from it
(``dslaunch.runtime.checkpoint.deepspeed_checkpoint``)."""

from dslaunch.runtime.checkpoint.deepspeed_checkpoint import (
    ARGS_KEY,
    CHECKPOINT_INFO_KEY,
    EMBEDDING_LAYER_INDEX,
    FINAL_LAYER_NORM_INDEX,
    ITERATION_KEY,
    LAYER_CONCAT_DIM,
    LAYER_FILE_PREFIX_PATTERN,
    SEQUENTIAL_LAYERS,
    DeepSpeedCheckpoint,
)

__all__ = ["ARGS_KEY", "CHECKPOINT_INFO_KEY", "EMBEDDING_LAYER_INDEX", "FINAL_LAYER_NORM_INDEX", "ITERATION_KEY",
           "LAYER_CONCAT_DIM", "LAYER_FILE_PREFIX_PATTERN", "SEQUENTIAL_LAYERS", "DeepSpeedCheckpoint"]
