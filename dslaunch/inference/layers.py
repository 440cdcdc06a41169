"""``dslaunch.inference.layers``: the sharded AutoTP layers, now shared with training; they live in
``dslaunch.runtime.tensor_parallel.layers``."""

from dslaunch.runtime.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLinear,
    quantize_int8,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelLinear", "VocabParallelEmbedding",
           "quantize_int8"]
