"""Whole values at any stage: DeepSpeed's ``safe_get_full_*`` and the consolidated state dict.

``deepspeed.utils`` names (re-exported by ``dslaunch.utils``): ``safe_get_full_fp32_param``,
``safe_get_full_grad``, ``safe_get_full_optimizer_state`` and ``safe_set_full_fp32_param``. A
parameter the engine trains knows its slot (``_dsl_slot``: strategy, group, index); its range of
the group's flat vector is gathered from the ranks that own it (``params.gather_range``).

collective: the getters at stages 1-3 (every rank must call them, same parameters, same order);
``safe_set_full_fp32_param`` is local (every rank passes the same value).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.runtime.heartbeat import wait_all
from dslaunch.runtime.zero import params as zp

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_set_full_fp32_param", "module_state_dict", "load_module_state_dict"]


def _slot(param: torch.nn.Parameter) -> tuple[Any, Any, int] | None:
    slot = getattr(param, "_dsl_slot", None)
    strategy = slot[0]() if slot is not None else None
    return None if strategy is None else (strategy, strategy.groups[slot[1]], slot[2])


def _shape(param: torch.nn.Parameter) -> torch.Size:
    return param.ds_shape if zp.is_partitioned(param) else param.shape


def _gather(strategy: Any, group: Any, local: torch.Tensor, index: int) -> torch.Tensor:
    """Elements of param ``index`` from ``local``, this rank's [start, end) of ``group``'s vector."""
    a, b = group.layout.param_range(index)
    if not strategy.partitioned:
        return local[a:b].clone()
    flat = zp.FlatShard(local, group.layout.numel, strategy.world_size, strategy.rank, strategy.pg)
    buf, works = zp.gather_range(flat, a, b)
    wait_all(works, "parameter gather (broadcast)")
    return buf


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master value of ``param`` (None: not trained by an engine)."""
    found = _slot(param)
    if found is None:
        return None
    strategy, group, i = found
    strategy.synchronize()
    return _gather(strategy, group, group.master.data, i).view(_shape(param))


def safe_get_full_optimizer_state(param: torch.nn.Parameter, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (e.g. ``exp_avg``) of ``param``."""
    found = _slot(param)
    if found is None:
        return None
    strategy, group, i = found
    state = strategy.optimizer.state.get(group.master, {}).get(optim_state_key)
    if state is None and getattr(strategy, "offload", None) is not None:  # NVMe: in the swap file
        state = strategy.offload.state_tensor(strategy.groups.index(group), optim_state_key)
    if not torch.is_tensor(state) or state.numel() != group.master.numel():
        return None
    return _gather(strategy, group, state, i).view(_shape(param))


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole averaged fp32 gradient of ``param`` (after backward, before the step; still
    multiplied by the fp16 loss scale, as DeepSpeed's)."""
    found = _slot(param)
    if found is None:
        return None
    strategy, group, i = found
    grads = strategy.gradients.shards()[strategy.groups.index(group)]
    full = _gather(strategy, group, grads, i).float()
    return full.mul_(strategy.comm.post_factor(strategy.world_size)).view(_shape(param))


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the fp32 master (and the model weights) of ``param`` to the whole ``value``."""
    found = _slot(param)
    if found is None:
        raise ValueError("safe_set_full_fp32_param: the parameter is not trained by a dslaunch engine")
    strategy, group, i = found
    strategy.synchronize()
    a, b = group.layout.param_range(i)
    lay, src = group.layout, value.detach().reshape(-1).float()
    lo, hi = max(a, lay.start), min(b, lay.end)
    if hi > lo:
        group.master.data[lo - lay.start:hi - lay.start].copy_(src[lo - a:hi - a])
    if zp.is_partitioned(param):
        zp.scatter_into(param, src)
    if not zp.is_partitioned(param) or param.ds_status is zp.ZeroParamStatus.AVAILABLE:
        param.data.copy_(src.view(_shape(param)))


def module_state_dict(module: torch.nn.Module, exclude_frozen: bool = False,
                      skip: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with whole parameters, on every rank (the engine's
    ``_zero3_consolidated_16bit_state_dict``, ``save_16bit_model`` and checkpoints).

    Partitioned parameters are gathered one module at a time (the whole model is built once, in
    the result), except those named in ``skip`` (the caller stores them elsewhere: their entries
    are placeholders). Without partitioned parameters this is ``module.state_dict()``.

    collective: every rank, when any parameter is partitioned.
    """
    from dslaunch.runtime.zero.partition_parameters import GatheredParameters

    if not any(zp.is_partitioned(p) for p in module.parameters()):
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
