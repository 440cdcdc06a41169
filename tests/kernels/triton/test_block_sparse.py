"""The Triton block-sparse products (interpreted, CPU tensors) against the torch reference
(``kernels/block_sparse/format.py``, itself tested against dense torch): the kept tiles of
``a @ b`` (strided operands too) and block-sparse times dense, plain and transposed, blocks 16 and
32, fp32/bf16/fp16; empty block rows write zeros; a block the kernel cannot take (8) runs the
reference. And ``MatMul`` really goes through the dispatch point."""

from __future__ import annotations

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.kernels.block_sparse import MatMul
from dslaunch.kernels.block_sparse import format as reference
from tests.kernels.triton.interpret import TOLERANCE, kernel_module, max_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _layout(heads: int, rows: int, cols: int, block: int) -> reference.BlockLayout:
    g = torch.Generator().manual_seed(block)
    layout = (torch.rand(heads, rows, cols, generator=g) < 0.5).long()
    layout[0, 1] = 0  # an empty block row (head 0, row 1)
    return reference.BlockLayout(layout, block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [16, 32])
def test_products_equal_the_torch_reference(block: int, dtype: torch.dtype) -> None:
    module = kernel_module("block_sparse")
    g = torch.Generator().manual_seed(0)
    lay = _layout(2, 3, 4, block)
    z, k, n = 2, 40, 70  # inner and column sizes that are not multiples of the kernel's steps
    a = torch.randn(z, 2, 3 * block, k, generator=g).to(dtype)
    b = torch.randn(z, 2, 4 * block, k, generator=g).to(dtype).transpose(-1, -2)  # strided
    got, want = module.sdd(a, b, lay), reference.sdd(a, b, lay)
    assert got.dtype == dtype and max_error(got, want) <= TOLERANCE[dtype]
    s = torch.randn(z, lay.nnz, block, block, generator=g).to(dtype)
    for transposed, rows in ((False, 4), (True, 3)):
        d = torch.randn(z, 2, rows * block, n, generator=g).to(dtype)
        got, want = module.spmm(s, transposed, d, lay), reference.spmm(s, transposed, d, lay)
        assert got.dtype == dtype and max_error(got, want) <= TOLERANCE[dtype], (transposed, max_error(got, want))
    assert module.spmm(s, False, torch.randn(z, 2, 4 * block, n).to(dtype), lay)[:, 0, block:2 * block].eq(0).all()


def test_a_block_below_16_runs_the_reference() -> None:
    module = kernel_module("block_sparse")
    lay = _layout(1, 2, 2, 8)
    a, b = torch.randn(1, 1, 16, 8), torch.randn(1, 1, 8, 16)
    assert torch.equal(module.sdd(a, b, lay), reference.sdd(a, b, lay))


def test_matmul_goes_through_the_dispatch_point(monkeypatch: pytest.MonkeyPatch) -> None:
    op = MatMul(torch.ones(1, 2, 2, dtype=torch.long), 16, "sdd")
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")  # no fused block-sparse kernel on CPU
    with pytest.raises(UsageError, match="block_sparse_sdd"):
        op(torch.randn(1, 1, 32, 8), torch.randn(1, 1, 8, 32))
