"""The Triton 1-bit compression kernels (interpreted, CPU tensors) against the torch reference,
bitwise: packed signs, scales, error feedback, unpacking per row and the mean over rows; odd sizes,
sizes that are not a multiple of the block, strided rows, zeros/-0.0/NaN/infinities."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.reference import pack_reference, unpack_reference
from tests.kernels.triton.interpret import kernel_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("nrows, row_bytes, pad", [(1, 1, 0), (2, 5, 3), (3, 700, 0), (4, 33, 1)])
def test_pack_and_unpack_equal_the_reference_bitwise(nrows: int, row_bytes: int, pad: int) -> None:
    onebit = kernel_module("onebit")
    n = 8 * nrows * row_bytes
    g = torch.Generator().manual_seed(nrows)
    x, error = torch.randn(n, generator=g), torch.rand(n, generator=g)
    if n >= 16:
        x[:5] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")])
    scale = 0.7315
    got = torch.zeros(nrows, row_bytes + 4 + pad, dtype=torch.uint8)[:, :row_bytes + 4]
    want = torch.zeros(nrows, row_bytes + 4, dtype=torch.uint8)
    got_err, want_err = error.clone(), error.clone()
    onebit.onebit_pack(x, got_err, got, scale)
    pack_reference(x, want_err, want, scale)
    assert torch.equal(got, want)
    assert torch.equal(_bits(got_err), _bits(want_err))
    want[:, -4:] = torch.rand(nrows, generator=g).view(torch.uint8).view(nrows, 4)
    got.copy_(want)
    for mean, size in ((False, n), (True, n // nrows)):
        out, ref = torch.zeros(size), torch.zeros(size)
        onebit.onebit_unpack(got, out, mean)
        unpack_reference(want, ref, mean)
        assert torch.equal(_bits(out), _bits(ref)), mean
