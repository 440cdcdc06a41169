"""The C 1-bit compression kernels against the torch reference, bitwise: packed signs, scales, the
error feedback and the unpacking (per row and the mean over 1-8 rows), with zeros, -0.0, NaN and
infinities among the values, odd row lengths, strided rows, both thread counts; tensors the C code
does not take fall back to the reference."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.cpu import build
from dslaunch.kernels.cpu.compress import onebit_pack, onebit_unpack
from dslaunch.kernels.reference import pack_reference, unpack_reference

pytestmark = [pytest.mark.skipif(not build.available(), reason="no C compiler: the torch reference runs"),
              pytest.mark.timeout(60)]


def _values(n: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if n >= 16:
        x[:6] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40])
    return x


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns: equal bits, not equal values (NaN, -0.0)."""
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


# (rows, bytes of signs per row): 1 row, several, odd lengths, one above the one-thread cut-off
@pytest.mark.parametrize("nrows, row_bytes", [(1, 1), (1, 3), (2, 5), (4, 129), (3, 1 << 14), (8, 17)])
def test_pack_and_unpack_equal_the_reference_bitwise(nrows: int, row_bytes: int, threads: int) -> None:
    n = 8 * nrows * row_bytes
    x, error = _values(n, 0), _values(n, 1).abs_().mul_(0.1)
    scale = float(torch.linalg.vector_norm(x.nan_to_num(0.0, 1.0, -1.0)) / n**0.5)
    got_x, got_err, want_x, want_err = x.clone(), error.clone(), x.clone(), error.clone()
    got, want = torch.zeros(nrows, row_bytes + 4, dtype=torch.uint8), torch.zeros(nrows, row_bytes + 4,
                                                                                   dtype=torch.uint8)
    onebit_pack(got_x, got_err, got, scale)
    pack_reference(want_x, want_err, want, scale)
    assert torch.equal(got, want)
    assert torch.equal(_bits(got_err), _bits(want_err))
    got[:, -4:] = torch.rand(nrows, generator=torch.Generator().manual_seed(2)).view(torch.uint8).view(nrows, 4)
    for mean, size in ((False, n), (True, n // nrows)):
        out, ref = torch.full((size,), 7.0), torch.full((size,), 7.0)
        onebit_unpack(got, out, mean)
        unpack_reference(got, ref, mean)
        assert torch.equal(_bits(out), _bits(ref)), (mean, (out - ref).abs().max())


def test_strided_rows_and_tensors_the_c_code_does_not_take() -> None:
    x = _values(8 * 2 * 5, 3)
    wide = torch.zeros(2, 5 + 4 + 3, dtype=torch.uint8)  # rows with room behind the scale: strided
    want = torch.zeros(2, 5 + 4, dtype=torch.uint8)
    err, ref_err = torch.zeros_like(x), torch.zeros_like(x)
    onebit_pack(x, err, wide[:, :9], 0.5)
    pack_reference(x, ref_err, want, 0.5)
    assert torch.equal(wide[:, :9], want) and torch.equal(wide[:, 9:], torch.zeros(2, 3, dtype=torch.uint8))
    assert torch.equal(_bits(err), _bits(ref_err))
    strided_x = torch.stack([x, x], dim=1)[:, 0]  # not contiguous: the reference runs
    err2 = torch.zeros_like(x)
    onebit_pack(strided_x, err2, wide[:, :9], 0.5)
    assert torch.equal(_bits(err2), _bits(ref_err))
    out = torch.zeros(2 * 8 * 2 * 5)[::2]
    onebit_unpack(want, out, False)
    assert torch.equal(out, torch.where(x >= 0, 0.5, -0.5))
