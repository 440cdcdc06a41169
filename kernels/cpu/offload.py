"""The offloaded optimizer step, fused into two passes over the gradients (ZeRO-Offload's CPU side):
``offload_adam_step``, ``offload_adagrad_step``, ``offload_lion_step`` (one frame, ``_offload_step``).

Inputs per flat partition: the fp32 master parameters with their optimizer states, the gradient
partition as it arrived from the device (bf16, fp16 or fp32, still multiplied by the loss scale),
and optionally the bf16/fp16 tensor that receives the updated parameters for the device.

- Pass 1 reads every gradient once: unscaled on the fly, its sum of squares accumulated in double.
  That sum is the overflow check as well: it is inf or NaN exactly when a gradient is (a finite
  fp32 value squared stays finite in double). The caller's ``all_reduce`` (a SUM over the ranks
  that hold the other partitions) makes it global, so every rank sees the same overflow and norm.
- Between the passes: overflow -> return, nothing written; else the clip coefficient from the
  global norm (torch's ``clip_grad_norm_``: ``max_norm / (norm + 1e-6)`` when the norm exceeds it).
- Pass 2 reads each gradient again, multiplied by ``clip / loss_scale``, updates the parameters
  and the optimizer's states, and writes the 16-bit copy in the same loop.

Two passes are the minimum with exact clipping: the coefficient needs the norm of all gradients
before any update. Unfused, the same step is ~8 passes (unscale, isfinite, norm, clip multiply,
the optimizer, the copy).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dslaunch.kernels.cpu import ops

__all__ = ["OffloadStepResult", "grad_sumsq", "offload_adam_step", "offload_adagrad_step", "offload_lion_step"]


@dataclass(frozen=True)
class OffloadStepResult:
    """What one offloaded step found.

    Attributes:
        overflow: a gradient was inf/NaN on some rank; nothing was updated (do not count the step).
        grad_norm: the global L2 norm of the unscaled gradients (inf/NaN on overflow).
        clip_coef: the factor the unscaled gradients were multiplied by (1.0 when not clipped).
    """

    overflow: bool
    grad_norm: float
    clip_coef: float


def grad_sumsq(grads: Sequence[torch.Tensor], loss_scale: float = 1.0) -> float:
    """Pass 1: the sum of squares of ``grad / loss_scale`` over ``grads`` (inf/NaN on overflow)."""
    return math.fsum(ops.grad_sumsq(g, 1.0 / loss_scale) for g in grads)


def _offload_step(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                  states: Sequence[Sequence[torch.Tensor]], copies: Sequence[torch.Tensor] | None,
                  loss_scale: float, max_grad_norm: float, all_reduce: Callable[[float], float] | None,
                  update: Callable[..., None]) -> OffloadStepResult:
    """The two passes around any optimizer: ``update(p, g, *states, grad_mul=, out=)`` per partition."""
    sumsq = grad_sumsq(grads, loss_scale)
    if all_reduce is not None:
        sumsq = all_reduce(sumsq)
    norm = math.sqrt(sumsq) if sumsq >= 0 else sumsq  # NaN stays NaN (sqrt would raise)
    if not math.isfinite(norm):
        return OffloadStepResult(True, norm, 1.0)
    clip = max_grad_norm / (norm + 1e-6) if 0 < max_grad_norm < norm else 1.0
    outs = list(copies) if copies is not None else [None] * len(masters)
    for p, g, out, *s in zip(masters, grads, outs, *states, strict=True):
        update(p, g, *s, grad_mul=clip / loss_scale, out=out)
    return OffloadStepResult(False, norm, clip)


def offload_adam_step(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *, step: int,
                      lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                      weight_decay: float = 0.0, bias_correction: bool = True, adamw_mode: bool = True,
                      loss_scale: float = 1.0, max_grad_norm: float = 0.0,
                      copies: Sequence[torch.Tensor] | None = None,
                      all_reduce: Callable[[float], float] | None = None) -> OffloadStepResult:
    """One Adam/AdamW step of flat partitions with unscale, overflow check, clipping and 16-bit copy.

    Args:
        masters, exp_avgs, exp_avg_sqs: contiguous fp32 CPU tensors, updated in place.
        grads: the matching gradient partitions (fp32, bf16 or fp16), multiplied by ``loss_scale``
            (fold any averaging over ranks into it); only read.
        step: the 1-based step count of this update (advance it only when no overflow).
        lr, betas, eps, weight_decay, bias_correction, adamw_mode: DeepSpeed's Adam parameters.
        max_grad_norm: clip the global norm to this (0: no clipping).
        copies: bf16/fp16 tensors shaped like ``masters`` that receive the updated parameters.
        all_reduce: sums a float over the ranks holding the other partitions (None: one rank).
            With it the call is collective: call on all ranks.

    Returns:
        ``OffloadStepResult``; on overflow nothing was written.
    """
    update = functools.partial(ops.adam, step=step, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                               weight_decay=weight_decay, bias_correction=bias_correction, adamw_mode=adamw_mode)
    return _offload_step(masters, grads, (exp_avgs, exp_avg_sqs), copies, loss_scale, max_grad_norm, all_reduce,
                         update)


def offload_adagrad_step(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                         state_sums: Sequence[torch.Tensor], *, lr: float, eps: float = 1e-10,
                         weight_decay: float = 0.0, loss_scale: float = 1.0, max_grad_norm: float = 0.0,
                         copies: Sequence[torch.Tensor] | None = None,
                         all_reduce: Callable[[float], float] | None = None) -> OffloadStepResult:
    """One Adagrad step (DeepSpeed's CPU Adagrad: ``lr``, ``eps``, ``weight_decay``) of flat
    partitions, in the two passes of ``offload_adam_step``, whose other arguments it shares.

    Args:
        state_sums: the fp32 sums of squared gradients (``exp_avg_sq`` in DeepSpeed), in place.
    """
    update = functools.partial(ops.adagrad, clr=lr, eps=eps, weight_decay=weight_decay)
    return _offload_step(masters, grads, (state_sums,), copies, loss_scale, max_grad_norm, all_reduce, update)


def offload_lion_step(masters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                      exp_avgs: Sequence[torch.Tensor], *, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                      weight_decay: float = 0.0, loss_scale: float = 1.0, max_grad_norm: float = 0.0,
                      copies: Sequence[torch.Tensor] | None = None,
                      all_reduce: Callable[[float], float] | None = None) -> OffloadStepResult:
    """One Lion step (DeepSpeed's CPU Lion: ``lr``, ``betas``, ``weight_decay``) of flat
    partitions, in the two passes of ``offload_adam_step``, whose other arguments it shares.

    Args:
        exp_avgs: the fp32 momentum, in place.
    """
    update = functools.partial(ops.lion, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay)
    return _offload_step(masters, grads, (exp_avgs,), copies, loss_scale, max_grad_norm, all_reduce, update)
