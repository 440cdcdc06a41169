"""DeepSpeed's ``FusedAdam`` with a multi-tensor step (re-exported by ``dslaunch.ops.adam``).

Arguments, defaults and ``zero_grad`` are DeepSpeed's FusedAdam's, the state is
``cpu.optimizers.DeepSpeedCPUAdam``'s (which it extends); ``step`` hands every parameter of a param group that shares a device and step count to ONE call of the
``"adam"`` op: on CUDA the Triton kernel (``triton/adam.py``, one launch for the whole list),
on CPU the C kernels, elsewhere or with ``DSLAUNCH_KERNELS=reference`` torch's ``_foreach`` ops.
Implementations that compute in fp32 whatever the storage dtype (``handles_dtypes``, the Triton
one) get bf16/fp16 parameters and gradients as they are; the others get fp32 contiguous copies,
written back after the update.

Limitations: no ``grads``/``output_params``/``scale``/``grad_norms``
arguments to ``step`` (DeepSpeed's deprecated ones), no AMSGrad, no sparse gradients.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dslaunch.kernels.cpu import optimizers

__all__ = ["FusedAdam"]


class FusedAdam(optimizers.DeepSpeedCPUAdam):
    """``deepspeed.ops.adam.FusedAdam``: Adam/AdamW, one ``"adam"`` op call per batch of parameters,
    on any device.

    Args:
        params, lr, bias_correction, betas, eps, weight_decay: as ``DeepSpeedCPUAdam``.
        adam_w_mode: decoupled weight decay (AdamW) instead of L2.
        amsgrad: must be False (RuntimeError, as DeepSpeed).
        set_grad_none: ``zero_grad()`` sets gradients to None.
    """

    cpu_only = False
    op = "adam"  # torch's rounding, as the Triton kernel's (DeepSpeedCPUAdam's "cpu_adam" is DeepSpeed's)

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=adam_w_mode)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None, grads: Any = None, output_params: Any = None, scale: Any = None,
             grad_norms: Any = None, grad_scaler: Any = None) -> Any:
        if any(a is not None for a in (grads, output_params, scale, grad_norms)):
            raise RuntimeError("FusedAdam.step() takes no grads, output_params, scale or grad_norms: build it "
                               "as torch.optim.Adam and call step() with no arguments")
        return super().step(closure)
