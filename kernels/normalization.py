"""Fused LayerNorm and RMSNorm: the ``"layer_norm"``/``"rms_norm"`` ops of ``dslaunch.kernels``.

Triton kernels on CUDA (forward and backward in one pass each, ``kernels/triton/norms.py``) for rows
of ``FUSED_MIN_FEATURES`` or more, torch's ``F.layer_norm``/``F.rms_norm`` for narrower rows,
elsewhere, or with ``DSLAUNCH_KERNELS=reference``.

- ``layer_norm(x, weight, bias, eps)``: the signature of DeepSpeed's inference Triton op
  (``deepspeed.ops.transformer.inference.triton.layer_norm.layer_norm``), with a backward.
- ``rms_norm(x, weight, eps)``.
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

__all__ = ["layer_norm", "rms_norm", "FusedLayerNorm", "FusedRMSNorm"]


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


class FusedLayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` through the fused kernel (apex's ``FusedLayerNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.normalized_shape)


class FusedRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` through the fused kernel (apex's ``FusedRMSNorm``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.normalized_shape)
