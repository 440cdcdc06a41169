"""Mixture of experts: DeepSpeed's ``deepspeed.moe`` parameter helpers, and expert parameters.

An expert parameter is marked as DeepSpeed marks it: ``param.allreduce = False`` and
``param.group_name = "ep_size_<N>"`` (the expert groups it belongs to, ``deepspeed.utils.groups``).
ZeRO averages its gradient over that name's expert-data group only and shards its state there
(``expert_group_name``; ``engine_setup`` gives it a param group of its own, as
``split_params_into_different_moe_groups_for_optimizer`` does for a client optimizer).

The ``MoE`` layer itself is refused on use (one line, ``dslaunch.utils.refused``); ``has_moe_layers``
is ``(False, 0)`` until it exists.

``deepspeed.moe.utils`` and ``deepspeed.moe.layer`` re-export these.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dslaunch.utils.refused import Refusal, refused_class

__all__ = ["MoE", "MOE_REFUSAL", "has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_into_shared_and_expert_params", "split_params_grads_into_shared_and_expert_params",
           "split_params_into_different_moe_groups_for_optimizer", "configure_moe_param_groups",
           "expert_group_name"]

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


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group an expert parameter reduces over (``param.group_name``); None for a dense one.

    Raises:
        UsageError: an expert parameter without a ``group_name`` of DeepSpeed's form ``ep_size_<N>``.
    """
    if not is_moe_param(param):
        return None
    name = getattr(param, "group_name", None)
    prefix, _, size = str(name).rpartition("_")
    if prefix != "ep_size" or not size.isdigit() or int(size) < 1:
        from dslaunch.errors import UsageError

        raise UsageError(f"a parameter marked as an expert's (allreduce = False) of shape {tuple(param.shape)} "
                         f"has group_name {name!r}: set param.group_name = \"ep_size_<N>\" (N: the expert "
                         "parallel size), as DeepSpeed's MoE layer does")
    return str(name)


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | float = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's param groups with expert parameters moved to groups of their own, as
    DeepSpeed does: each group keeps its dense parameters, and for each expert group name ``N``
    its expert parameters follow (after all the given groups) in groups ``{**group, "name": N,
    "moe": True}`` of at most ``max_group_size`` elements each (None: one group). The given dicts
    are changed in place (``params`` made lists), as DeepSpeed's are.

    Raises:
        ValueError: ``param_groups`` is not a dict, tuple or list of dicts.
        UsageError: an expert parameter without a ``group_name``.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    given = [list(group["params"]) for group in groups]  # (an iterator is read once)
    names = sorted({expert_group_name(p) for params in given for p in params if is_moe_param(p)})
    moved: list[dict[str, Any]] = []
    for group, params in zip(groups, given, strict=True):
        group["params"] = [p for p in params if not is_moe_param(p)]
        for name in names:
            mine = [p for p in params if is_moe_param(p) and p.group_name == name]
            for chunk in _chunks(mine, max_group_size):
                moved.append({**group, "name": name, "moe": True, "params": chunk})
    return groups + moved


def _chunks(params: list[torch.nn.Parameter], max_numel: int | float | None) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, cut into runs of at most ``max_numel`` elements (a larger parameter alone)."""
    if max_numel is None:
        return [params] if params else []
    out: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if not out or size + p.numel() > max_numel:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


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
