"""Reference implementations that belong to no dslaunch module: torch's own optimizer steps, and
the flat Adagrad update of DeepSpeed's CPU Adagrad.

The references of dslaunch's own optimizers live next to them (``runtime/optim/adam.py``,
``runtime/optim/lion.py``); ``dispatch.KERNELS`` names them all.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["torch_step", "adagrad_update"]


def torch_step(optimizer: Any, closure: Any = None) -> Any:
    """One step of ``optimizer`` as the ``torch.optim`` class it derives from computes it.

    The reference of the ``torch.*`` ops: ``optimizer`` is a subclass whose own ``step``
    dispatched here. torch wraps each class's ``step`` once, for its step hooks and the profiler;
    the subclass's step already ran them, so this calls the implementation under that wrapper.
    """
    base = next(c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim"))
    step = inspect.unwrap(base.step, stop=lambda f: not getattr(f, "hooked", False))
    return step(optimizer, closure)


def adagrad_update(params: list[Any], grads: list[Any], state_sums: list[Any], *, clr: float, eps: float,
                   weight_decay: float, inv_scale: float | None) -> None:
    """The reference ``"adagrad"`` kernel: one Adagrad step at learning rate ``clr``, in place.

    DeepSpeed's CPU Adagrad and torch's Adagrad (whose ``lr_decay`` the caller folds into
    ``clr``): ``g += wd * p; sum += g^2; p -= clr * g / (sqrt(sum) + eps)``.
    """
    import torch

    for p, g, s in zip(params, grads, state_sums, strict=True):
        g = g if inv_scale is None or inv_scale == 1.0 else g * inv_scale
        if weight_decay != 0.0:
            g = g.add(p, alpha=weight_decay)
        s.addcmul_(g, g)
        p.addcdiv_(g, torch.sqrt(s).add_(eps), value=-clr)
