"""Python entry points of ``compress.c``: the ``"onebit_pack"``/``"onebit_unpack"`` ops on CPU.

Both take the ops' signatures (``dslaunch.kernels``; the torch reference is in
``reference``) and hand any tensor the C code does not take (not fp32/uint8, not
contiguous rows, not on the CPU) to that reference. Threads: torch's.
"""

from __future__ import annotations

import torch

from dslaunch.kernels.cpu.ops import _lib, takes
from dslaunch.kernels.reference import SCALE_BYTES

__all__ = ["onebit_pack", "onebit_unpack"]



def _rows_ok(rows: torch.Tensor) -> bool:
    """uint8 (rows, signs + 4 scale bytes) on the CPU, each row's bytes contiguous."""
    return (rows.dtype is torch.uint8 and rows.is_cpu and rows.dim() == 2 and rows.stride(1) == 1
            and rows.shape[1] > SCALE_BYTES)


def onebit_pack(x: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """The signs of ``x`` into ``rows`` (``scale`` behind each row's signs); ``error`` = x - scale * sign(x)."""
    if not (takes(x, error) and _rows_ok(rows)):
        from dslaunch.kernels.reference import pack_reference

        pack_reference(x, error, rows, scale)
        return
    nrows, row_bytes = rows.shape[0], rows.shape[1] - SCALE_BYTES
    assert x.numel() == error.numel() == 8 * nrows * row_bytes, (x.numel(), error.numel(), tuple(rows.shape))
    rows[:, row_bytes:].copy_(torch.tensor([scale], dtype=torch.float32).view(torch.uint8))
    _lib().dsl_onebit_pack(x.data_ptr(), error.data_ptr(), rows.data_ptr(), nrows, row_bytes, rows.stride(0),
                           scale, torch.get_num_threads())


def onebit_unpack(rows: torch.Tensor, out: torch.Tensor, mean: bool) -> None:
    """``out`` = each row's signs times its scale (rows after rows), or their mean over the rows."""
    if not (takes(out) and _rows_ok(rows)):
        from dslaunch.kernels.reference import unpack_reference

        unpack_reference(rows, out, mean)
        return
    nrows, row_bytes = rows.shape[0], rows.shape[1] - SCALE_BYTES
    assert out.numel() == 8 * row_bytes * (1 if mean else nrows), (out.numel(), tuple(rows.shape), mean)
    _lib().dsl_onebit_unpack(rows.data_ptr(), nrows, row_bytes, rows.stride(0), out.data_ptr(), int(mean),
                             torch.get_num_threads())
