"""Whole values at any stage: DeepSpeed's ``safe_get/set_full_*`` and the consolidated state dict.

``deepspeed.utils`` names (re-exported by ``dslaunch.utils``): ``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state``, their setters ``safe_set_full_fp32_param``,
``safe_set_full_grad``, ``safe_set_full_optimizer_state``, and ``safe_update_full_grad_vectorized``.
Each rank's fragment of a parameter (``fragment.py``) is gathered from the ranks that own it
(``params.gather_range``) or written from the whole value. A setter writes where the next step
reads (the fp32 master, and the model weights; the gradient the step will apply; the optimizer
state, in the swap file with NVMe); the 16-bit copy of an optimizer state set is not kept.
Parameters not trained by an engine (frozen): getters return None, setters of grads and states do
nothing (as DeepSpeed's); ``safe_set_full_fp32_param`` raises.

collective: the getters at stages 1-3 and ``safe_update_full_grad_vectorized`` (every rank must
call them, same parameters, same order); the setters are local (every rank passes the same value).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero import params as zp
from dslaunch.runtime.zero.fragment import GRAD, PARAM, Fragment, locate, rank_tensor, write

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "safe_set_full_grad", "safe_set_full_optimizer_state",
           "safe_update_full_grad_vectorized", "module_state_dict", "load_module_state_dict", "shared_params"]


def _shape(param: torch.nn.Parameter) -> torch.Size:
    return param.ds_shape if zp.is_partitioned(param) else param.shape


def _get_full(param: torch.nn.Parameter, what: str) -> torch.Tensor | None:
    """The whole fp32 ``what`` of ``param``, gathered from the ranks that own its elements."""
    frag = locate(param)
    if frag is None:
        return None
    s = frag.strategy
    s.synchronize()
    own = s.unreduced_grad(frag.gi) if what == GRAD else None
    if own is not None:  # not reduced yet (no_sync, before the boundary): DeepSpeed's param.grad, this rank's sum
        return own[frag.a:frag.b].to(torch.float32, copy=True).view(_shape(param))
    local = rank_tensor(frag, what)
    if local is None:
        return None
    if not s.partitioned:
        full = local[frag.a:frag.b].to(torch.float32, copy=True)
    else:
        flat = zp.FlatShard(local, frag.group.layout.numel, *s.group_comm(frag.gi))
        full, works = zp.gather_range(flat, frag.a, frag.b)
        wait_all(works, "parameter gather (broadcast)")
        full = full.float()
    if what == GRAD:
        full.mul_(s.average_factor)
    return full.view(_shape(param))


def _set_full(frag: Fragment, what: str, value: torch.Tensor, name: str, param: torch.nn.Parameter) -> None:
    if value.numel() != frag.b - frag.a:
        raise ValueError(f"{name}: the value has {value.numel()} elements, the parameter "
                         f"{tuple(_shape(param))} has {frag.b - frag.a}")
    write(frag, what, value.detach().reshape(-1)[frag.lo - frag.a:frag.hi - frag.a])


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master value of ``param`` (None: not trained by an engine)."""
    return _get_full(param, PARAM)


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (e.g. ``exp_avg``) of ``param``."""
    return _get_full(param, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole averaged fp32 gradient of ``param`` (after backward, before the step; still
    multiplied by the fp16 loss scale, as DeepSpeed's). Before the gradients are reduced (inside
    ``no_sync()``, or after a backward before the accumulation boundary; stages 0 and 1) it is
    this rank's own sum so far, as DeepSpeed's ``param.grad`` there."""
    return _get_full(param, GRAD)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master (and the model weights) of ``param`` to the whole ``value``."""
    frag = locate(param)
    if frag is None:
        raise ValueError("safe_set_full_fp32_param: the parameter is not trained by a dslaunch engine")
    frag.strategy.synchronize()
    _set_full(frag, PARAM, value, "safe_set_full_fp32_param", param)
    src = value.detach().reshape(-1).float()
    if zp.is_partitioned(param):
        zp.scatter_into(param, src)
    if not zp.is_partitioned(param) or param.ds_status is zp.ZeroParamStatus.AVAILABLE:
        param.data.copy_(src.view(_shape(param)))


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the averaged gradient of ``param`` the next step applies to the whole ``value`` (after
    backward, before the step; fp16: multiplied by the loss scale, as ``safe_get_full_grad``'s)."""
    frag = locate(param)
    if frag is not None:
        _set_full(frag, GRAD, value, "safe_set_full_grad", param)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str) -> None:
    """Set the fp32 optimizer state ``optim_state_key`` of ``param`` to the whole ``value``.

    Raises:
        ValueError: the optimizer has no such state (before the first step, or another key).
    """
    frag = locate(param)
    if frag is not None:
        _set_full(frag, optim_state_key, value, "safe_set_full_optimizer_state", param)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor]) -> None:
    """Replace each parameter's whole gradient ``g`` by ``update_func(g, param)``: the averaged fp32
    gradient of a trained parameter, ``param.grad`` of one outside an engine (skipped without)."""
    for p in param_list:
        if locate(p) is None:
            if p.grad is not None:
                p.grad.copy_(update_func(p.grad, p))
            continue
        safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))


def shared_params(module: torch.nn.Module) -> dict[str, str]:
    """Each further name of a tied parameter -> its first name (DeepSpeed's ``shared_params``)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[name] = first[id(p)]
        else:
            first[id(p)] = name
    return out


def module_state_dict(module: torch.nn.Module, exclude_frozen: bool = False,
                      skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with whole parameters, on every rank (the engine's
    ``_zero3_consolidated_16bit_state_dict``, ``save_16bit_model`` and checkpoints).

    Partitioned parameters are gathered one module at a time (the whole model is built once, in
    the result), except those named in ``skip`` (the caller stores them elsewhere: their entries
    are placeholders). Without partitioned parameters this is ``module.state_dict()``. AutoEP's
    blocks keep this rank's experts (``moe/autoep_state.py``: ``unconverted_state_dict`` makes it
    the Hugging Face model's).

    collective: every rank, when any parameter is partitioned.
    """
    from dslaunch.runtime.moe.autoep_state import local_layout
    from dslaunch.runtime.zero.partition_parameters import GatheredParameters

    if not any(zp.is_partitioned(p) for p in module.parameters()):
        with local_layout(module):  # AutoEP's blocks: each rank's own experts (unconverted_state_dict)
            sd = module.state_dict()
    else:
        sd = {}
        for prefix, m in module.named_modules():
            pre = f"{prefix}." if prefix else ""
            with GatheredParameters([p for n, p in m.named_parameters(recurse=False) if pre + n not in skip]):
                # detached views keep the gathered storage alive after the release
                m._save_to_state_dict(sd, pre, False)
            for name, p in m._parameters.items():  # whole all along: the live weights, copy them
                if zp.is_partitioned(p) and p.ds_persist:
                    key = f"{prefix}.{name}" if prefix else name
                    sd[key] = sd[key].clone()
    if exclude_frozen:
        frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
        sd = {k: v for k, v in sd.items() if k not in frozen}
    return sd


def load_module_state_dict(module: torch.nn.Module, sd: Any, strict: bool, load: Any) -> Any:
    """``load(sd, strict)`` (a torch ``load_state_dict``) where partitioned parameters take their
    whole values from ``sd`` into their shards (and fp32 masters). Local: every rank passes the
    same ``sd``. Returns torch's ``(missing_keys, unexpected_keys)``.

    Raises:
        RuntimeError: as torch's: a shape that does not fit, or (``strict``) missing/unexpected keys.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    loaded = {k for k, p in params.items() if zp.is_partitioned(p) and k in sd}
    if not loaded:
        return load(sd, strict=strict)
    for key in sorted(loaded):
        p, value = params[key], sd[key]
        if tuple(value.shape) != tuple(p.ds_shape):
            raise RuntimeError(f"Error(s) in loading state_dict: size mismatch for {key}: copying a param "
                               f"with shape {tuple(value.shape)}, the shape in current model is "
                               f"{tuple(p.ds_shape)}")
        zp.scatter_into(p, value.to(p.dtype))
        if p.ds_status is zp.ZeroParamStatus.AVAILABLE:
            p.data.copy_(value)
    result = load({k: v for k, v in sd.items() if k not in loaded}, strict=False)
    result.missing_keys[:] = [k for k in result.missing_keys if k not in loaded]
    if strict and (result.missing_keys or result.unexpected_keys):
        raise RuntimeError(f"Error(s) in loading state_dict: missing keys {result.missing_keys[:5]}, "
                           f"unexpected keys {result.unexpected_keys[:5]}")
    return result
