"""``dslaunch.inference.auto_tp``: the AutoTP planner, now shared with training; it lives in
``dslaunch.runtime.tensor_parallel.auto_tp``."""

from dslaunch.runtime.tensor_parallel.auto_tp import (
    ShardSpec,
    TPPlan,
    head_plan,
    is_linear,
    linear_shape,
    plan_tensor_parallel,
)

__all__ = ["ShardSpec", "TPPlan", "plan_tensor_parallel", "is_linear", "head_plan", "linear_shape"]
