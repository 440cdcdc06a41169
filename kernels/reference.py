"""Reference implementations that belong to no dslaunch module: torch's own optimizer steps,
the flat Adagrad update of DeepSpeed's CPU Adagrad, and the norms and bias + GeLU of
``dslaunch.ops.normalization``/``dslaunch.ops.bias_gelu`` (torch's functional ops).

The references of dslaunch's own optimizers live next to them (``runtime/optim/adam.py``,
``runtime/optim/lion.py``); ``dispatch.KERNELS`` names them all.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = ["torch_step", "adagrad_update", "cpu_adam_update", "layer_norm", "rms_norm", "bias_gelu",
           "check_bias_gelu"]


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


def cpu_adam_update(params: list[Any], grads: list[Any], exp_avgs: list[Any], exp_avg_sqs: list[Any], *,
                    step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                    bias_correction: bool, adam_w_mode: bool, inv_scale: float | None,
                    chunk_numel: int | None = None) -> None:
    """The reference ``"cpu_adam"`` kernel: ``"adam"`` in DeepSpeed's ``DeepSpeedCPUAdam`` association.

    ``m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2; p += (-lr wd) p`` (AdamW mode);
    ``p += (-lr / bc1) (m / (sqrt(v) / sqrt(bc2) + eps))`` with the correction as a multiply, so
    one division per element. Same rounding steps as the C kernel except where it fuses a
    multiply-add (within an ulp).
    """
    import torch

    beta1, beta2 = betas
    bc1, bc2 = (1.0 - beta1**step, 1.0 - beta2**step) if bias_correction else (1.0, 1.0)
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        g = g if inv_scale is None or inv_scale == 1.0 else g * inv_scale
        if weight_decay != 0.0 and not adam_w_mode:
            g = g.add(p, alpha=weight_decay)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = torch.sqrt(v).mul_(1.0 / bc2**0.5).add_(eps)
        if weight_decay != 0.0 and adam_w_mode:
            p.add_(p, alpha=-lr * weight_decay)
        p.add_(m / denom, alpha=-lr / bc1)


def layer_norm(x: Any, weight: Any, bias: Any, eps: float = 1e-5, normalized_shape: Any = None) -> Any:
    """The reference ``"layer_norm"`` op: ``F.layer_norm`` over ``weight``'s shape (or ``normalized_shape``)."""
    import torch.nn.functional as F

    shape = tuple(weight.shape) if weight is not None else tuple(normalized_shape)
    return F.layer_norm(x, shape, weight, bias, eps)


def rms_norm(x: Any, weight: Any, eps: float = 1e-6, normalized_shape: Any = None) -> Any:
    """The reference ``"rms_norm"`` op: ``F.rms_norm`` over ``weight``'s shape (or ``normalized_shape``)."""
    import torch.nn.functional as F

    shape = tuple(weight.shape) if weight is not None else tuple(normalized_shape)
    return F.rms_norm(x, shape, weight, eps)


def check_bias_gelu(x: Any, bias: Any, approximate: str, p: float) -> None:
    """The argument checks both ``"bias_gelu"`` implementations share.

    Raises:
        ValueError: ``approximate`` not "none"/"tanh", ``p`` outside [0, 1), or a bias whose shape
            is not the input's trailing shape.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', not {approximate!r}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), not {p}")
    if bias.dim() == 0 or tuple(x.shape[x.dim() - bias.dim():]) != tuple(bias.shape):
        raise ValueError(f"bias of shape {list(bias.shape)} does not match the input's trailing dims "
                         f"{list(x.shape)}")


def bias_gelu(x: Any, bias: Any, approximate: str = "none", p: float = 0.0, training: bool = True,
              seed: int | None = None) -> Any:
    """The reference ``"bias_gelu"`` op: ``dropout(gelu(x + bias, approximate), p)`` in torch ops.

    ``seed`` seeds a generator of the input's device for the mask (None: torch's default one).
    """
    import torch
    import torch.nn.functional as F

    check_bias_gelu(x, bias, approximate, p)
    y = F.gelu(x + bias, approximate=approximate)
    if not training or p == 0.0:
        return y
    generator = None if seed is None else torch.Generator(device=x.device).manual_seed(seed)
    keep = torch.rand(y.shape, generator=generator, device=y.device) >= p
    return y * keep / (1.0 - p)
