"""DeepSpeed's ``deepspeed.module_inject`` import path: AutoTP's planner and the sharded layers.

DeepSpeed's ``AutoTP`` picks row-parallel layers by name; dslaunch's planner works on the traced
dataflow (``dslaunch.inference.auto_tp``). The layer names here are DeepSpeed's.
"""

from dslaunch.inference.auto_tp import ShardSpec, TPPlan, plan_tensor_parallel
from dslaunch.inference.layers import ColumnParallelLinear, RowParallelLinear

LinearLayer = ColumnParallelLinear  # DeepSpeed's names for its column / row layers
LinearAllreduce = RowParallelLinear

__all__ = ["plan_tensor_parallel", "ShardSpec", "TPPlan", "ColumnParallelLinear", "RowParallelLinear",
           "LinearLayer", "LinearAllreduce"]
