"""``deepspeed.module_inject.layers``: DeepSpeed's AutoTP training layers and mode.

``LinearLayer`` (column-parallel) and ``LinearAllreduce`` (row-parallel) wrap an ``nn.Linear`` by
hand (``dslaunch.runtime.tensor_parallel.deepspeed_layers``); ``set_autotp_mode`` and friends are
DeepSpeed's process-wide training/inference switch (``runtime/tensor_parallel/mode.py``). The other
layer classes of DeepSpeed's module (fused QKV, sub-parameter, Yuan, conv, embedding layers) are
its injection's internals: dslaunch's AutoTP shards with its own layers, and they are refused on use.
"""

from dslaunch.runtime.tensor_parallel.deepspeed_layers import TP_MARK as DS_TENSOR_MODEL_PARALLEL
from dslaunch.runtime.tensor_parallel.deepspeed_layers import (
    GatherReplacedLayerParams,
    LinearAllreduce,
    LinearLayer,
)
from dslaunch.runtime.tensor_parallel.deepspeed_layers import TensorParallelLayer as TensorParallel_Layer
from dslaunch.runtime.tensor_parallel.mode import (
    AUTOTP_MODE,
    get_auto_tp_mode,
    is_autotp_training_mode,
    set_autotp_mode,
)
from dslaunch.utils.refused import Refusal, refuse

DS_IS_REPLACED_MODULE = "ds_is_replaced_module"

_INTERNAL = Refusal("DeepSpeed's AutoTP injection layer classes (fused QKV, sub-parameter, Yuan, conv, "
                    "embedding and output-head variants)",
                    "wrap Linears with LinearLayer / LinearAllreduce, or let initialize shard the model "
                    "(tensor_parallel.autotp_size, with partition_config for hand-written rules)")
_REFUSED = ("LinearAllreduceWithReplicatedInput", "LmHeadLinearAllreduce", "Yuan_LinearAllreduce", "Yuan_LinearLayer",
            "GateUpPack_LinearLayer", "Conv_LinearALlreduce", "fused_LinearLayer", "conv_LinearLayer",
            "SubParamLinearLayer", "SubParamLinearAllreduce", "VocabParallelLinear", "VocabParallelEmbedding",
            "HiddenParallelEmbedding", "EmbeddingLayer", "OPTEmbedding", "Normalize", "RMSNormalize")
globals().update(refuse(__name__, _REFUSED, _INTERNAL))

__all__ = ["TensorParallel_Layer", "LinearLayer", "LinearAllreduce", "GatherReplacedLayerParams", "set_autotp_mode",
           "get_auto_tp_mode", "is_autotp_training_mode", "AUTOTP_MODE", "DS_TENSOR_MODEL_PARALLEL",
           "DS_IS_REPLACED_MODULE", *_REFUSED]
