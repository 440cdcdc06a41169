"""This rank's piece of a ZeRO-3 partitioned parameter: DeepSpeed's ``safe_get/set_local_*``.

``deepspeed.utils`` names (re-exported by ``dslaunch.utils``): ``safe_get_local_fp32_param``,
``safe_get_local_grad``, ``safe_get_local_optimizer_state`` and their setters
``safe_set_local_fp32_param``, ``safe_set_local_grad``, ``safe_set_local_optimizer_state``. The
piece is ``param.ds_tensor``'s range (1-D, ``ds_tensor.numel()`` elements; pieces follow the group's
flat layout, so one may be empty): the pieces of all ranks, in rank order, are the whole parameter.
A value is what ``fragment.py`` reads and writes (the setters reach the next step, and the fp32
master set also updates this rank's model shard; a whole copy kept by a persistent parameter on
another rank is refreshed by the next step). A parameter the engine does not train (frozen):
getters return None, setters do nothing, as DeepSpeed's.

collective: none; every function is local.
"""

from __future__ import annotations

import torch

from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.fragment import GRAD, PARAM, Fragment, locate, read, write

__all__ = ["safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
           "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state"]


def _fragment(param: torch.nn.Parameter, name: str) -> Fragment | None:
    """Raises ValueError: ``param`` is not partitioned (DeepSpeed asserts the same)."""
    if not zp.is_partitioned(param):
        raise ValueError(f"{name}: only defined for ZeRO-3 partitioned parameters (zero_optimization.stage 3); "
                         "use the safe_get/set_full_* functions at other stages")
    return locate(param)


def _get(param: torch.nn.Parameter, what: str, name: str) -> torch.Tensor | None:
    frag = _fragment(param, name)
    return None if frag is None else read(frag, what)


def _set(param: torch.nn.Parameter, value: torch.Tensor, what: str, name: str) -> Fragment | None:
    frag = _fragment(param, name)
    if frag is None:
        return None
    if value.numel() != frag.numel:
        raise ValueError(f"{name}: the value has {value.numel()} elements, this rank's piece of the parameter "
                         f"(param.ds_tensor) has {frag.numel}")
    write(frag, what, value)
    return frag


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the fp32 master of ``param`` (1-D)."""
    return _get(param, PARAM, "safe_get_local_fp32_param")


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's piece of the averaged fp32 gradient (after backward, before the step)."""
    return _get(param, GRAD, "safe_get_local_grad")


def safe_get_local_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """This rank's piece of the optimizer state ``optim_state_key`` (None: no such state)."""
    return _get(param, optim_state_key, "safe_get_local_optimizer_state")


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's piece of the fp32 master, and of the model weights, to ``value``."""
    frag = _set(param, value, PARAM, "safe_set_local_fp32_param")
    if frag is None or not frag.numel:
        return
    flat, src = param._dsl_flat, value.detach().reshape(-1)
    flat.write(frag.lo - flat.start, src.to(param.dtype))
    if param.ds_status is zp.ZeroParamStatus.AVAILABLE:
        param.data.view(-1)[frag.lo - frag.a:frag.hi - frag.a].copy_(src)


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set this rank's piece of the averaged gradient the next step applies to ``value``."""
    _set(param, value, GRAD, "safe_set_local_grad")


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set this rank's piece of the optimizer state ``optim_state_key``.

    Raises:
        ValueError: the optimizer has no such state (before the first step, or another key).
    """
    _set(param, value, optim_state_key, "safe_set_local_optimizer_state")
