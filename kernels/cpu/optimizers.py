"""DeepSpeed's optimizer classes over dslaunch's kernels: ``DeepSpeedCPUAdam``, ``DeepSpeedCPUAdagrad``,
``DeepSpeedCPULion`` (re-exported by ``dslaunch.ops.adam``/``.adagrad``/``.lion``; ``FusedAdam``,
built on ``DeepSpeedCPUAdam``, is ``dslaunch.kernels.fused_adam``'s).

Constructor arguments, defaults, state keys (``step`` as an int, ``exp_avg``, ``exp_avg_sq``) and
``step()`` semantics follow DeepSpeed 0.19.8. The update is the ``"adam"``, ``"adagrad"`` or
``"lion"`` op of ``dslaunch.kernels``: the C kernels on CPU (no JIT build of minutes: the library
compiles in well under a second on first use), the torch reference elsewhere or with
``DSLAUNCH_KERNELS=reference``. Parameters that are not fp32 (or states kept in the parameter dtype,
``fp32_optimizer_states=False``) are updated through fp32 copies, as DeepSpeed computes in fp32.

Limitations: no ``step_subgroup``/``rollback_subgroup`` (ZeRO-3 offload's per-subgroup calls);
sparse gradients are refused (DeepSpeed's CPU Adagrad accepts them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from dslaunch import kernels

__all__ = ["DeepSpeedCPUAdam", "DeepSpeedCPUAdagrad", "DeepSpeedCPULion"]


class _KernelOptimizer(torch.optim.Optimizer):
    """``step()``: per parameter with a gradient, lazily created states, ``step += 1``, then ``_update``."""

    state_keys: ClassVar[tuple[str, ...]]
    cpu_only: ClassVar[bool] = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool = True):
        super().__init__(params, defaults)
        self.fp32_optimizer_states = fp32_optimizer_states

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self.cpu_only and p.device.type != "cpu":
                    raise RuntimeError(f"{type(self).__name__}: a parameter is on {p.device} and must be on the "
                                       "CPU; enable 'offload_optimizer': {'device': 'cpu'} in the ZeRO config")
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self._state(group, p)
                state["step"] += 1
                # DeepSpeed computes in fp32: other dtypes go through fp32 copies, written back.
                tensors = [p.data, *(state[k] for k in self.state_keys)]
                f32 = [_fp32(t) for t in tensors]
                self._update(group, state["step"], f32[0], _fp32(p.grad), f32[1:])
                for t, t32 in zip(tensors, f32, strict=True):
                    if t32 is not t:
                        t.copy_(t32)
        return loss

    def _state(self, group: dict[str, Any], p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            dtype = torch.float32 if self.fp32_optimizer_states else p.dtype
            for key in self.state_keys:
                state[key] = torch.zeros_like(p, dtype=dtype)
        return state

    def _update(self, group: dict[str, Any], step: int, p: torch.Tensor, grad: torch.Tensor,
                states: list[torch.Tensor]) -> None:
        raise NotImplementedError


def _fp32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


class DeepSpeedCPUAdam(_KernelOptimizer):
    """Adam/AdamW on CPU parameters (DeepSpeed's ``deepspeed.ops.adam.DeepSpeedCPUAdam``).

    Args:
        model_params: parameters or param groups (on the CPU).
        lr, betas, eps, weight_decay: as torch's Adam.
        bias_correction: divide the moments by (1 - beta^t).
        amsgrad: must be False (DeepSpeed refuses it too).
        adamw_mode: decoupled weight decay (AdamW) instead of L2; for the whole optimizer.
        fp32_optimizer_states: keep the moments in fp32 whatever the parameter dtype.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True):
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                    "bias_correction": bias_correction, "amsgrad": amsgrad}
        super().__init__(model_params, defaults, fp32_optimizer_states)
        self.adam_w_mode = adamw_mode

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if param_group.get("amsgrad", self.defaults["amsgrad"]):
            raise RuntimeError(f"{type(self).__name__} does not support the AMSGrad variant.")
        super().add_param_group(param_group)

    def _update(self, group, step, p, grad, states):
        kernels.get("adam", p.device)(
            [p], [grad], [states[0]], [states[1]], step=step, lr=float(group["lr"]), betas=group["betas"],
            eps=group["eps"], weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
            adam_w_mode=bool(self.adam_w_mode), inv_scale=None)


class DeepSpeedCPUAdagrad(_KernelOptimizer):
    """Adagrad on CPU parameters (DeepSpeed's ``deepspeed.ops.adagrad.DeepSpeedCPUAdagrad``).

    ``g += weight_decay * p; exp_avg_sq += g^2; p -= lr * g / (sqrt(exp_avg_sq) + eps)``.
    """

    state_keys = ("exp_avg_sq",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                 amsgrad: bool = False, fp32_optimizer_states: bool = True):
        super().__init__(model_params, {"lr": lr, "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad},
                         fp32_optimizer_states)

    def _update(self, group, step, p, grad, states):
        kernels.get("adagrad", p.device)([p], [grad], states, clr=float(group["lr"]), eps=group["eps"],
                                         weight_decay=group["weight_decay"], inv_scale=None)


class DeepSpeedCPULion(_KernelOptimizer):
    """Lion on CPU parameters (DeepSpeed's ``deepspeed.ops.lion.DeepSpeedCPULion``)."""

    state_keys = ("exp_avg",)

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0, fp32_optimizer_states: bool = True):
        super().__init__(model_params, {"lr": lr, "betas": betas, "weight_decay": weight_decay},
                         fp32_optimizer_states)

    def _update(self, group, step, p, grad, states):
        kernels.get("lion", p.device)([p], [grad], states, lr=float(group["lr"]), betas=group["betas"],
                                      weight_decay=group["weight_decay"], inv_scale=None)
