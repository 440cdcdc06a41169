"""Mixture of experts: what a dense (non-MoE) job needs of DeepSpeed's ``deepspeed.moe`` API.

dslaunch has no expert layers yet, so ``MoE`` is refused on use (one line, ``dslaunch.utils.refused``)
while the parameter helpers scripts call unconditionally keep DeepSpeed's answers for a model
without experts: ``has_moe_layers`` is ``(False, 0)``, no parameter is an expert parameter unless
marked as DeepSpeed marks them (``param.allreduce = False``), and splitting param groups for the
optimizer returns them as they are (as lists). A parameter marked as an expert's is refused: its
gradients would need the expert-parallel reduction dslaunch does not have.

``deepspeed.moe.utils`` and ``deepspeed.moe.layer`` re-export these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dslaunch.utils.refused import Refusal, refused_class

__all__ = ["MoE", "MOE_REFUSAL", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_into_shared_and_expert_params", "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "configure_moe_param_groups"]

MOE_REFUSAL = Refusal("mixture of experts (expert parallelism)",
                      "train a dense model (the script's non-MoE path), or use DeepSpeed for MoE")

MoE = refused_class("dslaunch.moe.layer", "MoE", MOE_REFUSAL)


def has_moe_layers(m: torch.nn.Module) -> tuple[bool, int]:
    """``(True, num_experts)`` of the first ``MoE`` layer in ``m``; ``(False, 0)`` without one."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's mark of an expert parameter: an ``allreduce`` attribute set to False."""
    return getattr(param, "allreduce", True) is False


def is_moe_param_group(param_group: Mapping[str, Any]) -> bool:
    return bool(param_group.get("moe", False))


def split_params_into_shared_and_expert_params(params: Iterable[torch.nn.Parameter]
                                               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """``(shared, expert)`` parameters, in order."""
    shared: list[torch.nn.Parameter] = []
    expert: list[torch.nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(group: Iterable[torch.nn.Parameter]
                                                     ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared, expert)`` gradients (in each parameter's dtype) of the parameters that have one."""
    shared, expert = split_params_into_shared_and_expert_params(p for p in group if p.grad is not None)
    return [p.grad.to(p.dtype) for p in shared], [p.grad.to(p.dtype) for p in expert]


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | float = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's param groups with expert parameters split off, as DeepSpeed does.

    Without expert parameters (always, in dslaunch) the groups come back unchanged, as a list of
    the same dicts with each ``params`` made a list. ``max_group_size`` only bounds expert groups.

    Raises:
        NotInDslaunchError: a parameter is marked as an expert's (``allreduce = False``).
        ValueError: ``param_groups`` is not a dict, tuple or list of dicts.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in groups:
        group["params"] = list(group["params"])
        if any(is_moe_param(p) for p in group["params"]):
            raise MOE_REFUSAL.error("split_params_into_different_moe_groups_for_optimizer(expert parameters)")
    return groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]] | list[Any]:
    """Param groups ready for an MoE-aware optimizer: a list of parameters becomes one group named
    ``dense-params``; a list of groups is split as above unless it already has ``moe`` groups."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    if model_parameters and isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                      "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
