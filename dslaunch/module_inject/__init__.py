"""DeepSpeed's ``deepspeed.module_inject`` import path: AutoTP's planner, the sharded layers, and the
fused BERT layer's surgery.

DeepSpeed's ``AutoTP`` picks row-parallel layers by name; dslaunch's planner works on the traced
dataflow (``dslaunch.runtime.tensor_parallel.auto_tp``). ``LinearLayer`` / ``LinearAllreduce``
(``layers.py``) are DeepSpeed's hand-built layers, with its signatures; ``tp_shard.py`` its split.
``replace_module.py``: ``replace_transformer_layer`` / ``revert_transformer_layer`` /
``replace_module``, putting DeepSpeed's fused training layer (``DeepSpeedTransformerLayer``) into
a BERT-family model and back (``dslaunch.runtime.transformer_inject``); ``replace_policy.py``: its
``HFBertLayerPolicy``, the other per-architecture policies (inference kernel injection) refused on
use. AutoEP's paths: ``auto_ep.py`` (``AutoEP``), ``auto_ep_config.py`` (``AutoEPConfig``,
``parse_autoep_config``), ``auto_ep_layer.py`` (``AutoEPMoELayer``), re-exporting
``dslaunch.runtime.moe.autoep``; ``auto_ep_folding.py`` (the rank tables of AutoEP folded with
AutoTP, ``dslaunch.runtime.moe.folding``). ``auto_tp.py``: DeepSpeed's ``AutoTP`` surgery class,
refused on use.
"""

from dslaunch.module_inject.layers import LinearAllreduce, LinearLayer, set_autotp_mode
from dslaunch.module_inject.replace_module import replace_transformer_layer, revert_transformer_layer
from dslaunch.module_inject.replace_policy import HFBertLayerPolicy
from dslaunch.runtime.tensor_parallel.auto_tp import ShardSpec, TPPlan, plan_tensor_parallel
from dslaunch.runtime.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["plan_tensor_parallel", "ShardSpec", "TPPlan", "ColumnParallelLinear", "RowParallelLinear",
           "LinearLayer", "LinearAllreduce", "set_autotp_mode", "replace_transformer_layer", "revert_transformer_layer",
           "HFBertLayerPolicy"]
