"""The update of one bucket of a flat fp32 master slice, for the optimizers that have a CPU kernel.

An offloaded step updates the master shard bucket by bucket, so it cannot call
``optimizer.step()`` (which updates the whole shard at once). A ``Rule`` does the same update on
a slice: it reads the param group's hyperparameters and this step's count once per step
(``begin``), then updates any slice with the matching slices of the state tensors (``apply``).

- Adam/AdamW (torch's classes, dslaunch's and DeepSpeed's FusedAdam semantics): the fused C kernel
  (``kernels.cpu.ops.adam``: gradient scaling, update and the 16-bit copy in one pass, the second
  pass of ``offload_adam_step``).
- Adagrad (torch's) and Lion (dslaunch's): the single-op kernels through ``dslaunch.kernels``.

Each goes through ``dslaunch.kernels.get``, so kernels that are unavailable or
``DSLAUNCH_KERNELS=reference`` run the torch reference on the same slices. The state layout stays
the optimizer's own (``optimizer.state[master]``: same keys, a ``step`` tensor), so
``state_dict`` and checkpoints do not change. Other optimizers (or options such as ``amsgrad``)
have no rule: the offloaded step runs torch's ``optimizer.step()`` over the whole shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dslaunch import kernels

__all__ = ["Rule", "rule_for"]

@dataclass(frozen=True)
class Rule:
    """How to update slices for one optimizer type.

    ``state_keys``: the per-element state tensors (shaped like the master); ``begin(optimizer,
    group_index)`` advances the step count and returns the arguments of ``apply(args, param,
    grad, states, grad_mul, out)``, which updates ``param`` and ``states`` in place (``out``: a
    16-bit tensor to receive the new parameters, or None).
    """

    name: str
    state_keys: tuple[str, ...]
    begin: Callable[[torch.optim.Optimizer, int], dict[str, Any]]
    apply: Callable[..., None]


def _count(opt: torch.optim.Optimizer, master: torch.Tensor) -> int:
    state = opt.state[master]
    step = state.get("step")
    # A tensor, as torch's optimizers keep it (out of place: a loaded state may be shared).
    state["step"] = torch.tensor(1.0) if step is None else step + 1
    return int(state["step"].item())


def _adam_begin(opt: torch.optim.Optimizer, gi: int) -> dict[str, Any]:
    group = opt.param_groups[gi]
    from dslaunch.runtime.optim.adam import Adam as DslAdam

    if isinstance(opt, DslAdam):
        bias, adamw = group["bias_correction"], group["adam_w_mode"]
    else:
        bias = True
        adamw = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
    return {"step": _count(opt, group["params"][0]), "lr": float(group["lr"]), "betas": tuple(group["betas"]),
            "eps": group["eps"], "weight_decay": group["weight_decay"], "bias_correction": bias,
            "adam_w_mode": adamw}


def _adam_apply(args: dict[str, Any], p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                grad_mul: float, out: torch.Tensor | None) -> None:
    op = kernels.get("adam", p.device)
    from dslaunch.kernels.cpu import ops

    if op is ops.adam_op and ops.takes(p, g, *states):  # the fused kernel writes the copy in the same pass
        ops.adam(p, g, states[0], states[1], step=args["step"], lr=args["lr"], beta1=args["betas"][0],
                 beta2=args["betas"][1], eps=args["eps"], weight_decay=args["weight_decay"],
                 bias_correction=args["bias_correction"], adamw_mode=args["adam_w_mode"], grad_mul=grad_mul,
                 out=out)
        return
    op([p], [g], [states[0]], [states[1]], inv_scale=grad_mul, **args)
    if out is not None:
        out.copy_(p)


def _adagrad_begin(opt: torch.optim.Optimizer, gi: int) -> dict[str, Any]:
    group = opt.param_groups[gi]
    step = _count(opt, group["params"][0])
    return {"clr": float(group["lr"]) / (1 + (step - 1) * group["lr_decay"]), "eps": group["eps"],
            "weight_decay": group["weight_decay"]}


def _adagrad_apply(args: dict[str, Any], p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                   grad_mul: float, out: torch.Tensor | None) -> None:
    kernels.get("adagrad", p.device)([p], [g], [states[0]], inv_scale=grad_mul, **args)
    if out is not None:
        out.copy_(p)


def _lion_begin(opt: torch.optim.Optimizer, gi: int) -> dict[str, Any]:
    group = opt.param_groups[gi]
    return {"lr": float(group["lr"]), "betas": tuple(group["betas"]), "weight_decay": float(group["weight_decay"])}


def _lion_apply(args: dict[str, Any], p: torch.Tensor, g: torch.Tensor, states: list[torch.Tensor],
                grad_mul: float, out: torch.Tensor | None) -> None:
    kernels.get("lion", p.device)([p], [g], [states[0]], inv_scale=grad_mul, **args)
    if out is not None:
        out.copy_(p)


ADAM = Rule("adam", ("exp_avg", "exp_avg_sq"), _adam_begin, _adam_apply)
ADAGRAD = Rule("adagrad", ("sum",), _adagrad_begin, _adagrad_apply)
LION = Rule("lion", ("exp_avg",), _lion_begin, _lion_apply)


def rule_for(opt: torch.optim.Optimizer) -> Rule | None:
    """The rule for ``opt``'s update, or None when only ``opt.step()`` computes it."""
    from dslaunch.runtime.optim.adam import Adam as DslAdam
    from dslaunch.runtime.optim.lion import Lion

    groups = opt.param_groups
    if not _known_step(opt):  # a subclass that changed the update
        return None
    if isinstance(opt, DslAdam):
        return ADAM
    if isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        plain = all(not g.get(k) for g in groups for k in ("amsgrad", "maximize", "capturable", "differentiable"))
        return ADAM if plain else None
    if isinstance(opt, torch.optim.Adagrad):
        return ADAGRAD if all(not g.get("maximize") for g in groups) else None
    if isinstance(opt, Lion):
        return LION
    return None


def _known_step(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step`` is one this module knows (torch's, or dslaunch's kernel-dispatching
    subclasses of torch's classes); a user subclass overriding it gets no rule."""
    for cls in type(opt).__mro__:
        if "step" in vars(cls):
            return cls.__module__.startswith(("torch.optim", "dslaunch.runtime.optim"))
    return False
