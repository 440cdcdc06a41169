"""Bias + GeLU (+ dropout) in Triton, forward and backward (the ``"bias_gelu"`` op).

``y = dropout(gelu(x + bias), p)`` with torch's ``approximate="none"`` (erf) or ``"tanh"`` GeLU,
computed in fp32 per element. Dropout keeps an element when a Philox draw (``tl.rand(seed, i)``,
``i`` the element's index in the contiguous output) is ``>= p`` and scales kept ones by
``1 / (1 - p)``: the same seed gives the same mask, and the backward draws it again instead of
saving it (no mask tensor in memory). The mask is not torch's (another generator), only its law.
The bias gradient is a torch ``sum`` over the rows of the input gradient.

Limitations: the mask repeats every 2**32 elements of one call (32-bit Philox counters); ``x``
is made contiguous (one copy when it is not).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from dslaunch.kernels.reference import check_bias_gelu

__all__ = ["bias_gelu"]

_BLOCK = 1024
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # jit code reads globals only as constexpr
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _tanh(u):
    # 1 - 2 / (e^{2u} + 1), no libdevice needed; |u| <= 20 keeps e^{2u} finite (tanh(20) is 1 in fp32).
    u = tl.minimum(tl.maximum(u, -20.0), 20.0)
    return 1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)


@triton.jit
def _bias_gelu_kernel(X, B, DY, OUT, numel, n, p, scale, seed,
                      TANH: tl.constexpr, DROPOUT: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: > 2**31 elements
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z = z + tl.load(B + offs % n, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        t = _tanh(_SQRT_2_OVER_PI * (z + 0.044715 * z * z * z))
        if BACKWARD:
            g = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * z * z)
        else:
            g = 0.5 * z * (1.0 + t)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(z * _INV_SQRT_2))
        if BACKWARD:
            g = cdf + z * _INV_SQRT_2PI * tl.exp(-0.5 * z * z)
        else:
            g = z * cdf
    if BACKWARD:
        g = g * tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        g = tl.where(tl.rand(seed, offs.to(tl.int32)) >= p, g * scale, 0.0)  # 32-bit Philox: the fast one
    tl.store(OUT + offs, g.to(OUT.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, bias: torch.Tensor, dy: torch.Tensor | None, p: float, seed: int,
            tanh: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    if x.numel():
        _bias_gelu_kernel[(triton.cdiv(x.numel(), _BLOCK),)](
            x, bias, dy, out, x.numel(), bias.numel(), float(p), 1.0 / (1.0 - p) if p > 0 else 1.0, seed,
            TANH=tanh, DROPOUT=p > 0, BACKWARD=dy is not None, BLOCK=_BLOCK)
    return out


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor, p: float, seed: int, tanh: bool) -> torch.Tensor:
        x = x.contiguous()
        bias = bias.contiguous()
        ctx.save_for_backward(x, bias)
        ctx.p, ctx.seed, ctx.tanh = p, seed, tanh
        return _launch(x, bias, None, p, seed, tanh)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, bias = ctx.saved_tensors
        dz = _launch(x, bias, dy.contiguous(), ctx.p, ctx.seed, ctx.tanh)
        dbias = dz.reshape(-1, bias.numel()).sum(0, dtype=torch.float32).to(bias.dtype).view(bias.shape)
        return dz, dbias, None, None, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none", p: float = 0.0,
              training: bool = True, seed: int | None = None) -> torch.Tensor:
    """The ``"bias_gelu"`` op: ``dropout(gelu(x + bias, approximate), p)``; ``bias`` spans x's last dims.

    Args:
        seed: the dropout seed (same seed, same mask); None draws one from torch's generator, so
            ``torch.manual_seed`` makes runs repeatable. Unused when ``p == 0`` or not ``training``.

    Raises:
        ValueError: bad arguments (``reference.check_bias_gelu``).
    """
    check_bias_gelu(x, bias, approximate, p)
    p = p if training else 0.0
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu")) if p > 0 else 0
    return _BiasGeLU.apply(x, bias, p, seed, approximate == "tanh")
