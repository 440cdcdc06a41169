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

from dslaunch import kernels
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
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for (device, step), params in self._batches(group).items():
                self._update_batch(group, device, step, params)
        return loss

    def _batches(self, group: dict[str, Any]) -> dict[tuple[Any, ...], list[torch.Tensor]]:
        """The group's parameters with a gradient by (device, step), steps counted; dtypes split later."""
        batches: dict[tuple[Any, ...], list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("FusedAdam does not support sparse gradients")
            state = self._state(group, p)
            state["step"] += 1
            batches.setdefault((p.device, state["step"]), []).append(p)
        return batches

    def _update_batch(self, group: dict[str, Any], device: torch.device, step: int,
                      params: list[torch.Tensor]) -> None:
        update = kernels.get("adam", device)
        keep_dtype = getattr(update, "handles_dtypes", False)
        lists = [[p.data for p in params], [p.grad for p in params],
                 [self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params]]
        staged = [[_staged(t, keep_dtype) for t in x] for x in lists]
        update(*staged, step=step, lr=float(group["lr"]), betas=group["betas"], eps=group["eps"],
               weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
               adam_w_mode=bool(self.adam_w_mode), inv_scale=None)
        for xs, ss in zip(lists[:1] + lists[2:], staged[:1] + staged[2:], strict=True):  # not the grads
            for t, s in zip(xs, ss, strict=True):
                if s is not t:
                    t.copy_(s)


def _staged(t: torch.Tensor, keep_dtype: bool) -> torch.Tensor:
    """``t`` itself when the kernel can take it, else a contiguous (fp32) copy."""
    t = t if keep_dtype else t.float()
    return t if t.is_contiguous() else t.contiguous()
