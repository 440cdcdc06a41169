"""Fused bias + GeLU (+ dropout): the ``"bias_gelu"`` op of ``dslaunch.kernels``.

``bias_gelu(x, bias, approximate, p, training, seed)`` computes ``dropout(gelu(x + bias), p)`` (the
"bias_gelu" of DeepSpeed's inference ops and Megatron's ``bias_gelu_impl``, plus dropout) in one
Triton kernel on CUDA, forward and backward, torch ops elsewhere. ``BiasGeLU`` is the module that
owns the bias.
"""

from __future__ import annotations

import torch

from dslaunch import kernels

__all__ = ["bias_gelu", "BiasGeLU"]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", p: float = 0.0,
              training: bool = True, seed: int | None = None) -> torch.Tensor:
    """``dropout(gelu(x + bias, approximate), p)``; ``bias`` spans x's trailing dims.

    Args:
        approximate: "none" (erf) or "tanh", as ``torch.nn.functional.gelu``.
        p, training: the dropout probability, applied only when training.
        seed: fixes the dropout mask (same seed, same mask on one implementation); None draws from
            torch's generator. The mask differs between the Triton and torch implementations.

    Raises:
        ValueError: a bad ``approximate``, ``p`` or bias shape.
    """
    return kernels.get("bias_gelu", x.device)(x, bias, approximate, p, training, seed)


class BiasGeLU(torch.nn.Module):
    """A bias of ``features`` elements, then GeLU, then dropout (``bias_gelu``)."""

    def __init__(self, features: int, approximate: str = "none", p: float = 0.0,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(features, device=device, dtype=dtype))
        self.approximate, self.p = approximate, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, self.bias, self.approximate, self.p, self.training)
