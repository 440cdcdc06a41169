"""1-bit compression in Triton (the ``"onebit_pack"``/``"onebit_unpack"`` ops on CUDA devices).

The torch reference is ``reference.pack_reference``/``reference.unpack_reference``;
these compute the same thing, operation by operation, bitwise:

- pack: one program per ``BLOCK`` bytes of signs reads their 8 * ``BLOCK`` elements once, writes
  the packed byte (``x >= 0``, first element in the high bit) and the error
  ``(x + (bit ? -2 scale : 0)) + scale``;
- unpack: each byte's 8 signs times its row's scale, or their mean over the rows (summed in row
  order, divided with ``div_rn``: Triton's plain ``/`` is not correctly rounded on GPUs).

The scales travel behind each row's signs (4 bytes, maybe unaligned): the wrapper reads and writes
them with torch (a few bytes), the kernels take them as an fp32 tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dslaunch.kernels.reference import SCALE_BYTES

__all__ = ["onebit_pack", "onebit_unpack"]

_BLOCK = 512  # bytes of signs per program: 4096 elements


@triton.jit
def _pack_kernel(X, ERR, ROWS, total, row_bytes, stride, scale, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # byte index; int64: > 2**31 elements
    k = tl.arange(0, 8)
    offs = b[:, None] * 8 + k[None, :]
    mask = b < total
    x = tl.load(X + offs, mask=mask[:, None], other=0.0)
    nonneg = x >= 0.0
    tl.store(ERR + offs, (x + tl.where(nonneg, -2.0 * scale, 0.0)) + scale, mask=mask[:, None])
    packed = tl.sum(nonneg.to(tl.int32) << (7 - k)[None, :], axis=1)
    tl.store(ROWS + (b // row_bytes) * stride + b % row_bytes, packed.to(tl.uint8), mask=mask)


@triton.jit
def _unpack_kernel(ROWS, SCALES, OUT, nrows, count, row_bytes, stride, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    k = tl.arange(0, 8)
    offs = b[:, None] * 8 + k[None, :]
    if MEAN:
        mask = b < row_bytes
        acc = tl.zeros((BLOCK, 8), dtype=tl.float32)
        for r in range(nrows):
            s = tl.load(SCALES + r)
            v = tl.load(ROWS + r * stride + b, mask=mask, other=0).to(tl.int32)
            acc += tl.where(((v[:, None] >> (7 - k)[None, :]) & 1) != 0, s, -s)
        tl.store(OUT + offs, tl.math.div_rn(acc, count), mask=mask[:, None])
    else:
        mask = b < nrows * row_bytes
        r = b // row_bytes
        s = tl.load(SCALES + r, mask=mask, other=0.0)
        v = tl.load(ROWS + r * stride + b % row_bytes, mask=mask, other=0).to(tl.int32)
        bits = ((v[:, None] >> (7 - k)[None, :]) & 1) != 0
        tl.store(OUT + offs, tl.where(bits, s[:, None], -s[:, None]), mask=mask[:, None])


def _check(rows: torch.Tensor, *floats: torch.Tensor) -> None:
    assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.stride(1) == 1, (rows.dtype, rows.stride())
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in floats), [t.dtype for t in floats]


def onebit_pack(x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """As ``compression.pack_reference``: signs of ``x`` into ``rows`` (scale behind each row), error kept."""
    _check(rows, x, error)
    nrows, row_bytes = rows.shape[0], rows.shape[1] - SCALE_BYTES
    total = nrows * row_bytes
    assert x.numel() == error.numel() == 8 * total, (x.numel(), error.numel(), tuple(rows.shape))
    rows[:, row_bytes:].copy_(torch.tensor([scale], dtype=torch.float32).view(torch.uint8))
    if total:
        _pack_kernel[(triton.cdiv(total, _BLOCK),)](x, error, rows, total, row_bytes, rows.stride(0), scale,
                                                   BLOCK=_BLOCK)


def onebit_unpack(rows: torch.Tensor, out: torch.Tensor, mean: bool) -> None:
    """As ``compression.unpack_reference``: signs times scales, row after row, or their mean."""
    _check(rows, out)
    nrows, row_bytes = rows.shape[0], rows.shape[1] - SCALE_BYTES
    assert out.numel() == 8 * row_bytes * (1 if mean else nrows), (out.numel(), tuple(rows.shape), mean)
    scales = rows[:, row_bytes:].reshape(-1).clone().view(torch.float32)  # clone: aligned
    total = row_bytes if mean else nrows * row_bytes
    if total:  # count: fp32 (an int 1 would become a constexpr)
        _unpack_kernel[(triton.cdiv(total, _BLOCK),)](rows, scales, out, nrows, float(nrows), row_bytes, rows.stride(0),
                                                     MEAN=mean, BLOCK=_BLOCK)
