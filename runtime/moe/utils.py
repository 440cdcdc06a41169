"""DeepSpeed's ``deepspeed.moe.utils``: which parameters are experts', and param groups for them.

An expert parameter carries DeepSpeed's marks (set by ``Experts``): ``allreduce = False`` and a
``group_name`` (``ep_size_<N>``). The optimizer wants them in groups of their own, flagged
``moe: True`` and named by that group name, because ZeRO reduces and partitions them over the
expert-data group rather than the data-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dslaunch.runtime.moe.layer import MoE
from dslaunch.runtime.parallel.groups import ep_size_of

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group", "expert_group_name",
           "split_params_into_shared_and_expert_params",
           "split_params_grads_into_shared_and_expert_params", "split_params_into_different_moe_groups_for_optimizer",
           "configure_moe_param_groups"]


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


def expert_group_name(param: torch.Tensor) -> str | None:
    """The expert group an expert parameter reduces over (``param.group_name``); None for a dense one.

    Raises:
        UsageError: an expert parameter without a ``group_name`` of DeepSpeed's form ``ep_size_<N>``.
    """
    if not is_moe_param(param):
        return None
    name = getattr(param, "group_name", None)
    if ep_size_of(name) is None:
        from dslaunch.errors import UsageError

        raise UsageError(f"a parameter marked as an expert's (allreduce = False) of shape {tuple(param.shape)} "
                         f"has group_name {name!r}: set param.group_name = \"ep_size_<N>\" (N: the expert "
                         "parallel size), as DeepSpeed's MoE layer does")
    return str(name)


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


def _chunks(params: list[torch.nn.Parameter], max_size: int | float) -> list[list[torch.nn.Parameter]]:
    """``params`` in order, cut into runs of at most ``max_size`` elements (a larger parameter alone)."""
    runs: list[list[torch.nn.Parameter]] = []
    size = 0
    for p in params:
        if runs and size + p.numel() <= max_size:
            runs[-1].append(p)
            size += p.numel()
        else:
            runs.append([p])
            size = p.numel()
    return runs


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | float | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's param groups with expert parameters moved to groups of their own, as DeepSpeed does.

    Each group keeps its dense parameters (as a list); after all of them come, for each group and
    each expert group name its parameters carry, copies of the group's options with ``name`` the
    expert group's name, ``moe: True`` and those parameters, cut into groups of at most
    ``max_group_size`` elements (None: uncut). Dicts given are changed in place, as DeepSpeed's are.

    Raises:
        ValueError: ``param_groups`` is not a dict, tuple or list of dicts; a group holding expert
            parameters has no ``name``.
        UsageError: an expert parameter without a ``group_name`` (``expert_group_name``).
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    expert_groups: list[dict[str, Any]] = []
    for index, group in enumerate(groups):
        params = list(group["params"])
        shared, expert = split_params_into_shared_and_expert_params(params)
        group["params"] = shared
        if expert and "name" not in group:
            raise ValueError(f"param group {index} holds expert parameters but has no 'name' (DeepSpeed's split "
                             "names each expert group after its source group); give every group a 'name'")
        by_name: dict[str, list[torch.nn.Parameter]] = {}
        for p in expert:
            by_name.setdefault(expert_group_name(p), []).append(p)
        for name, members in by_name.items():
            runs = [members] if max_group_size is None else _chunks(members, max_group_size)
            expert_groups += [{**group, "name": name, "moe": True, "params": run} for run in runs]
    return groups + expert_groups


def configure_moe_param_groups(model_parameters: list[Any]) -> list[dict[str, Any]] | list[Any]:
    """Param groups ready for an MoE-aware optimizer: a list of parameters becomes one group named
    ``dense-params`` (split as above); a list of groups is split as above unless it already has ``moe`` groups."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    if model_parameters and isinstance(model_parameters[0], torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer({"params": model_parameters,
                                                                      "name": "dense-params"})
    if any("moe" in group for group in model_parameters):
        return model_parameters
    return split_params_into_different_moe_groups_for_optimizer(model_parameters)
