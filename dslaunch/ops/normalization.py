"""Fused LayerNorm and RMSNorm: the ``"layer_norm"``/``"rms_norm"`` ops of ``dslaunch.kernels``.

Triton kernels on CUDA (forward and backward in one pass each, ``kernels/triton/norms.py``), torch's
``F.layer_norm``/``F.rms_norm`` elsewhere or with ``DSLAUNCH_KERNELS=reference``.

- ``layer_norm(x, weight, bias, eps)``: the signature of DeepSpeed's inference Triton op
  (``deepspeed.ops.transformer.inference.triton.layer_norm.layer_norm``), with a backward.
- ``rms_norm(x, weight, eps)``.
- ``FusedLayerNorm``/``FusedRMSNorm``: apex's class names (``apex.normalization``); drop-in
  subclasses of ``torch.nn.LayerNorm``/``torch.nn.RMSNorm`` (same arguments and ``state_dict``;
  ``torch.nn.RMSNorm`` and ``F.rms_norm`` need torch >= 2.4).
"""

from __future__ import annotations

from typing import Any

import torch

from dslaunch import kernels

__all__ = ["layer_norm", "rms_norm", "FusedLayerNorm", "FusedRMSNorm"]


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               normalized_shape: Any = None) -> torch.Tensor:
    """LayerNorm of ``x`` over ``weight``'s shape (``normalized_shape`` when there is no weight)."""
    return kernels.get("layer_norm", x.device)(x, weight, bias, eps, normalized_shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None = None,
             normalized_shape: Any = None) -> torch.Tensor:
    """RMSNorm of ``x``; ``eps`` None is ``torch.finfo(x.dtype).eps``, as ``torch.nn.RMSNorm``."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    return kernels.get("rms_norm", x.device)(x, weight, eps, normalized_shape)


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` through the fused kernel (apex's ``FusedLayerNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.normalized_shape)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` through the fused kernel (apex's ``FusedRMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.normalized_shape)
