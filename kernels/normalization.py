"""Fused LayerNorm and RMSNorm: the ``"layer_norm"``/``"rms_norm"`` ops of ``dslaunch.kernels``.

Triton kernels on CUDA (forward and backward in one pass each, ``kernels/triton/norms.py``) for rows
of ``FUSED_MIN_FEATURES`` or more, torch's ``F.layer_norm``/``F.rms_norm`` for narrower rows,
elsewhere, or with ``DSLAUNCH_KERNELS=reference``.

- ``layer_norm(x, weight, bias, eps)``: the signature of DeepSpeed's inference Triton op
  (``deepspeed.ops.transformer.inference.triton.layer_norm.layer_norm``), with a backward.
- ``rms_norm(x, weight, eps)``.
- ``invertible_layer_norm(x, weight, bias, eps)``: LayerNorm whose backward recomputes its input
  from its output (DeepSpeed's ``normalize_invertible``): the input activation is not kept.
- ``FusedLayerNorm``/``FusedRMSNorm``: apex's class names (``apex.normalization``); drop-in
  subclasses of ``torch.nn.LayerNorm``/``torch.nn.RMSNorm`` (same arguments and ``state_dict``;
  ``torch.nn.RMSNorm`` and ``F.rms_norm`` need torch >= 2.4).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dslaunch import kernels
from dslaunch.kernels import reference

__all__ = ["layer_norm", "rms_norm", "invertible_layer_norm", "FusedLayerNorm", "FusedRMSNorm"]


FUSED_MIN_FEATURES = 8192
"""Rows narrower than this go to torch's own norm kernels. The Triton kernels take less device time
at every width (BENCHMARKS.md's norm probe), but a call costs ~60 us of Python forward and 330-630
us backward: inside the step of a 1.1B GPT (width 2048, bf16, one H200, ``gpu_engine_bench.py``)
they made the step 8% slower. From 8192 features they win even called back to back."""


def _op(name: str, x: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any) -> Any:
    features = math.prod(weight.shape if weight is not None else normalized_shape)
    return kernels.get(name, x.device) if features >= FUSED_MIN_FEATURES else getattr(reference, name)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               normalized_shape: Any = None) -> torch.Tensor:
    """LayerNorm of ``x`` over ``weight``'s shape (``normalized_shape`` when there is no weight)."""
    return _op("layer_norm", x, weight, normalized_shape)(x, weight, bias, eps, normalized_shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None,
             normalized_shape: Any = None) -> torch.Tensor:
    """RMSNorm of ``x``; ``eps`` None is ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm``."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return _op("rms_norm", x, weight, normalized_shape)(x, weight, eps, normalized_shape)


class _InvertibleLayerNorm(torch.autograd.Function):
    """LayerNorm over the last dim saving its output, weight, bias and 1/std (one float per row),
    not its input: backward gets the normalized input back as ``(y - bias) / weight``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        var, mean = torch.var_mean(xf, dim=-1, keepdim=True, correction=0)
        rstd = torch.rsqrt(var + eps)
        y = ((xf - mean) * rstd * weight.float() + bias.float()).to(x.dtype)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        y, weight, bias, rstd = ctx.saved_tensors
        w = weight.float()
        # a zero weight loses the input (as in DeepSpeed's kernel); keep its sign and stay finite
        safe_w = torch.where(w.abs() < 1e-12, torch.full_like(w, 1e-12).copysign(w), w)
        x_hat = (y.float() - bias.float()) / safe_w
        g = grad.float()
        rows = tuple(range(g.dim() - 1))
        grad_weight, grad_bias = (g * x_hat).sum(rows), g.sum(rows)
        gx_hat = g * w
        grad_x = rstd * (gx_hat - gx_hat.mean(-1, keepdim=True) - x_hat * (gx_hat * x_hat).mean(-1, keepdim=True))
        return grad_x.to(grad.dtype), grad_weight.to(weight.dtype), grad_bias.to(bias.dtype), None


def invertible_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm of ``x`` over its last dim that keeps no copy of ``x`` for backward.

    Statistics in fp32 whatever ``x``'s dtype. Limitations: the input is recovered by dividing by
    ``weight``, so a weight element at 0 loses that feature's gradient (DeepSpeed's kernel shares
    this); in fp16/bf16 the recovered input carries the output's rounding.
    """
    return _InvertibleLayerNorm.apply(x, weight, bias, eps)


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` through the fused kernel (apex's ``FusedLayerNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.normalized_shape)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` through the fused kernel (apex's ``FusedRMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.normalized_shape)
