"""LayerNorm and RMSNorm in Triton, forward and backward (the ``"layer_norm"``/``"rms_norm"`` ops).

One program per row holds the whole row (``N`` up to ``MAX_N`` features) and computes in fp32:
the forward saves each row's mean (LayerNorm) and 1/std for the backward, which computes the input
gradient row by row and the weight/bias gradients as per-program partial sums over a strided set of
rows, added up by one torch ``sum`` (deterministic: no atomics). Inputs are viewed as ``(rows, N)``
with ``N`` the product of ``weight``'s shape; a non-contiguous input is copied once.

Limitations: ``N > MAX_N`` raises (rows that large would spill registers; use the reference with
``DSLAUNCH_KERNELS=reference``); ``weight``/``bias`` must be given together with a LayerNorm
(``elementwise_affine=False`` works: both None).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

__all__ = ["layer_norm", "rms_norm", "MAX_N"]

MAX_N = 65536
_GROUPS = 256  # programs computing partial weight/bias gradients: enough to fill an H100's SMs


@triton.jit
def _norm_fwd(X, Y, W, B, Mean, Rstd, stride_x, stride_y, N, eps,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # row * stride may pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / N
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(Mean + row, mean)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
    tl.store(Rstd + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd(X, DY, DX, W, Mean, Rstd, DW, DB, M, N, stride_x, stride_dy, stride_dx,
              RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    group = tl.program_id(0)
    groups = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    if HAS_W:
        w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.full((BLOCK,), 1.0, dtype=tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(group, M, groups):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(Mean + row)) * rstd, 0.0)
        wdy = w * dy
        # d/dx of (x - mean) * rstd: subtract the mean of wdy (LayerNorm only) and its xhat part.
        dx = wdy - xhat * (tl.sum(wdy * xhat, axis=0) / N)
        if not RMS:
            dx = dx - tl.sum(wdy, axis=0) / N
        tl.store(DX + row * stride_dx + cols, (dx * rstd).to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_W:
        tl.store(DW + group.to(tl.int64) * N + cols, dw, mask=mask)
    if HAS_B:
        tl.store(DB + group.to(tl.int64) * N + cols, db, mask=mask)


def _warps(n: int) -> int:
    """Warps per row: ~8 fp32 values per thread, as Triton's LayerNorm tutorial, so long rows do not spill."""
    return min(max(triton.next_power_of_2(n) // 256, 1), 16)


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    x2 = x.reshape(-1, n) if n else x.reshape(-1, 0)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


class _NormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                eps: float, rms: bool, n: int) -> torch.Tensor:
        if n > MAX_N:
            raise ValueError(f"the Triton {'RMSNorm' if rms else 'LayerNorm'} takes up to {MAX_N} features, "
                             f"not {n}; set DSLAUNCH_KERNELS=reference for torch's")
        x2 = _rows(x, n)
        rows = x2.shape[0]
        y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        if x.numel():
            _norm_fwd[(rows,)](x2, y, weight, bias, mean, rstd, x2.stride(0), y.stride(0), n, float(eps),
                               RMS=rms, HAS_W=weight is not None, HAS_B=bias is not None,
                               BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
        ctx.save_for_backward(x2, weight, bias, mean, rstd)
        ctx.rms, ctx.n = rms, n
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x2, weight, bias, mean, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy2 = _rows(dy, n)
        dx = torch.empty_like(x2)
        groups = max(1, min(rows, _GROUPS))
        # every program stores its partial sums; with no rows nothing runs and the sums are zero
        alloc = torch.empty if rows else torch.zeros
        partial = alloc((2, groups, n), dtype=torch.float32, device=x2.device)
        if x2.numel():
            _norm_bwd[(groups,)](x2, dy2, dx, weight, mean, rstd, partial[0], partial[1], rows, n,
                                 x2.stride(0), dy2.stride(0), dx.stride(0), RMS=ctx.rms,
                                 HAS_W=weight is not None, HAS_B=bias is not None,
                                 BLOCK=triton.next_power_of_2(n), num_warps=_warps(n))
        dw = partial[0].sum(0).to(weight.dtype).view(weight.shape) if weight is not None else None
        db = partial[1].sum(0).to(bias.dtype).view(bias.shape) if bias is not None else None
        return dx.view(dy.shape), dw, db, None, None, None


def _features(x: torch.Tensor, weight: torch.Tensor | None, normalized_shape: Any) -> int:
    shape = tuple(weight.shape) if weight is not None else tuple(normalized_shape)
    if tuple(x.shape[x.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized shape {list(shape)} does not match the input's trailing dims {list(x.shape)}")
    return int(torch.Size(shape).numel())


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5,
               normalized_shape: Any = None) -> torch.Tensor:
    """The ``"layer_norm"`` op: ``F.layer_norm`` over ``weight``'s shape (or ``normalized_shape``)."""
    return _NormFunction.apply(x, weight, bias, eps, False, _features(x, weight, normalized_shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6,
             normalized_shape: Any = None) -> torch.Tensor:
    """The ``"rms_norm"`` op: ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing dims."""
    return _NormFunction.apply(x, weight, None, eps, True, _features(x, weight, normalized_shape))
