"""The fused ``"torch.adam"``, ``"torch.adamw"`` and ``"torch.adagrad"`` ops: torch's optimizer
step, same state layout (``step`` as a 0-dim fp32 tensor, ``exp_avg``/``exp_avg_sq`` or ``sum``),
computed by the C kernels.

Each step first checks that the C kernels compute exactly what torch would: every parameter with
a gradient is a contiguous fp32 CPU tensor with a dense contiguous fp32 gradient, and no group uses
an option the kernels lack (``amsgrad``, ``maximize``, ``capturable``, ``differentiable``). Otherwise
the whole step is torch's own (``reference.torch_step``). torch's AMP protocol is honoured as by
torch's fused optimizers: gradients are divided by ``grad_scale`` inside the update, and a non-zero
``found_inf`` skips the step (no state changes).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch.kernels.cpu import ops
from dslaunch.kernels.reference import torch_step

__all__ = ["adam_step", "adagrad_step"]

_UNSUPPORTED = ("amsgrad", "maximize", "capturable", "differentiable")


def _plain(optimizer: Any, state_keys: tuple[str, ...]) -> bool:
    for group in optimizer.param_groups:
        if any(group.get(k, False) for k in _UNSUPPORTED):
            return False
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state.get(p, {})
            if p.grad.is_sparse or not ops.takes(p, p.grad, *(state[k] for k in state_keys if k in state)):
                return False
    return True


def _amp(optimizer: Any) -> tuple[bool, float]:
    """(skip this step, what gradients are divided by) from torch's AMP attributes."""
    found_inf = getattr(optimizer, "found_inf", None)
    if found_inf is not None and float(found_inf) != 0.0:
        return True, 1.0
    grad_scale = getattr(optimizer, "grad_scale", None)
    return False, 1.0 if grad_scale is None else float(grad_scale)


def _closure_loss(closure: Any) -> Any:
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _next_step(state: dict[str, Any]) -> int:
    state["step"] = state["step"] + 1  # out of place: a loaded state_dict may share the tensor
    return int(state["step"].item())


@torch.no_grad()
def adam_step(optimizer: torch.optim.Adam, closure: Any = None) -> Any:
    """One step of a ``torch.optim.Adam``/``AdamW`` (decoupled when ``AdamW`` or
    ``decoupled_weight_decay``), by the C kernel where it computes the same."""
    if not _plain(optimizer, ("exp_avg", "exp_avg_sq")):
        return torch_step(optimizer, closure)
    loss = _closure_loss(closure)
    skip, grad_div = _amp(optimizer)
    if skip:
        return loss
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    for group in optimizer.param_groups:
        beta1, beta2 = (float(b) for b in group["betas"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            ops.adam(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=_next_step(state),
                     lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], bias_correction=True,
                     adamw_mode=decoupled or bool(group.get("decoupled_weight_decay", False)),
                     grad_div=grad_div)
    return loss


@torch.no_grad()
def adagrad_step(optimizer: torch.optim.Adagrad, closure: Any = None) -> Any:
    """One step of a ``torch.optim.Adagrad`` (its ``lr_decay`` included), by the C kernel."""
    # torch creates Adagrad's state in the constructor: a missing one (e.g. a param group added
    # later) is left to torch.
    if not _plain(optimizer, ("sum",)) or any(
            "sum" not in optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]
            if p.grad is not None):
        return torch_step(optimizer, closure)
    loss = _closure_loss(closure)
    skip, grad_div = _amp(optimizer)
    if skip:
        return loss
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            step = _next_step(state)
            clr = float(group["lr"]) / (1 + (step - 1) * group["lr_decay"])
            ops.adagrad(p, p.grad, state["sum"], clr=clr, eps=group["eps"], weight_decay=group["weight_decay"],
                        grad_div=grad_div)
    return loss
