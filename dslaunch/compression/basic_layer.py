"""``deepspeed.compression.basic_layer``: the compressing layers (from
``dslaunch.runtime.compression.layers``); Megatron's model-parallel variants are refused on use."""

from dslaunch.runtime.compression.layers import (
                    BNLayer_Compress,
                    Conv2dLayer_Compress,
                    Embedding_Compress,
                    LinearLayer_Compress,
)
from dslaunch.runtime.compression.quantizers import QuantAct
from dslaunch.utils.refused import Refusal, refuse

_MEGATRON = Refusal("Compressing Megatron's model-parallel linear layers (an mpu's ColumnParallelLinear/RowParallelLinear)",
                    "compress a model of torch.nn layers; AutoTP (tensor_parallel.autotp_size) shards it afterwards")
_REFUSED = ("ColumnParallelLinear_Compress", "RowParallelLinear_Compress")
globals().update(refuse(__name__, _REFUSED, _MEGATRON))

__all__ = ["LinearLayer_Compress", "Conv2dLayer_Compress", "Embedding_Compress", "BNLayer_Compress", "QuantAct",
           *_REFUSED]
