"""Mixture of experts with expert parallelism (DeepSpeed's ``deepspeed.moe``).

``gate`` routes tokens (``TopKGate``, top-1/top-2/top-k gating), ``experts`` holds a rank's expert
copies, ``layer`` has ``MoE`` and the all-to-all ``MOELayer``, ``utils`` the expert-parameter
helpers. ``dslaunch/moe/`` re-exports them at DeepSpeed's import paths.
"""

from dslaunch.runtime.moe.experts import Experts
from dslaunch.runtime.moe.gate import TopKGate, top1gating, top2gating, topkgating
from dslaunch.runtime.moe.layer import MoE, MOELayer
from dslaunch.runtime.moe.utils import (
    configure_moe_param_groups,
    has_moe_layers,
    is_moe_param,
    is_moe_param_group,
    split_params_grads_into_shared_and_expert_params,
    split_params_into_different_moe_groups_for_optimizer,
    split_params_into_shared_and_expert_params,
)

__all__ = ["MoE", "MOELayer", "TopKGate", "Experts", "top1gating", "top2gating", "topkgating", "has_moe_layers",
           "is_moe_param", "is_moe_param_group", "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "configure_moe_param_groups"]
