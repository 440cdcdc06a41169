"""The block-sparse ops (``kernels/block_sparse``) against dense masked torch, forward and backward.

Mirrors DeepSpeed's ``unit/ops/sparse_attention/test_sparse_attention.py`` (which skips without
CUDA): random layouts of density 0.5, each ``MatMul`` mode with and without transposed operands
at block sizes 16, 32 and 64, and the ``Softmax`` with scale, relative position embedding, an
additive key padding mask and a multiplicative attention mask; every result and gradient is
compared in the block-sparse format with a dense torch computation where the dropped tiles are
zero (products) or -inf (softmax). Tolerance: fp32 rtol 5e-4, atol 5e-5 (DeepSpeed's for fp32),
bf16 and fp16 against the fp32 reference of the same rounded inputs at rtol 3e-2, atol 2e-2. Memory: a dispatch mode records
every tensor the ops create; none is near the dense square.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dslaunch.errors import SparsityConfigError
from dslaunch.kernels.block_sparse import MatMul, Softmax
from dslaunch.ops.sparse_attention import matmul as ds_matmul
from dslaunch.ops.sparse_attention import softmax as ds_softmax

TOL = {torch.float32: (5e-4, 5e-5), torch.bfloat16: (3e-2, 2e-2), torch.float16: (3e-2, 2e-2)}


def to_blocks(w: torch.Tensor, layout: torch.Tensor, block: int) -> torch.Tensor:
    """Dense ``[Z, H, M, N]`` -> its kept tiles ``[Z, nnz, block, block]`` in ``nonzero()`` order."""
    tiles = [w[:, h, i * block:(i + 1) * block, j * block:(j + 1) * block] for h, i, j in layout.nonzero().tolist()]
    return torch.stack(tiles, 1)


def masked(w: torch.Tensor, layout: torch.Tensor, block: int, fill: float = 0.0) -> torch.Tensor:
    """Dense ``w`` with the dropped tiles set to ``fill``."""
    keep = layout.repeat_interleave(block, 1).repeat_interleave(block, 2).bool()
    return w.masked_fill(~keep, fill)


def random_layout(heads: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(heads, rows, cols, generator=g) < 0.5).long()


def close(x: torch.Tensor, y: torch.Tensor) -> None:
    rtol, atol = TOL[x.dtype]
    torch.testing.assert_close(x.float(), y.float(), rtol=rtol, atol=atol)


def _matmul_case(mode: str, ta: bool, tb: bool, block: int, dtype: torch.dtype) -> None:
    z, h, m, n, k = 2, 2, 2 * block, 3 * block, 2 * block
    a_shape = (k, m) if ta else (m, k)
    b_shape = (n, k) if tb else (k, n)
    sparse_shape = {"sdd": (m, n), "dsd": a_shape, "dds": b_shape}[mode]
    layout = random_layout(h, sparse_shape[0] // block, sparse_shape[1] // block, seed=block + len(mode))
    g = torch.Generator().manual_seed(1)
    a0, b0 = torch.randn(z, h, *a_shape, generator=g), torch.randn(z, h, *b_shape, generator=g)
    dy = torch.randn(z, h, m, n, generator=g)
    # the reference sees the inputs as rounded to dtype, so only the op's own rounding is measured
    a0, b0, dy = (t.to(dtype).float() for t in (a0, b0, dy))
    # dense reference in fp32
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    ad = masked(a, layout, block) if mode == "dsd" else a
    bd = masked(b, layout, block) if mode == "dds" else b
    y = (ad.transpose(-1, -2) if ta else ad) @ (bd.transpose(-1, -2) if tb else bd)
    y = masked(y, layout, block) if mode == "sdd" else y
    y.backward(dy)
    ref_y = to_blocks(y.detach(), layout, block) if mode == "sdd" else y.detach()
    ref_da = to_blocks(a.grad, layout, block) if mode == "dsd" else a.grad
    ref_db = to_blocks(b.grad, layout, block) if mode == "dds" else b.grad
    # block-sparse
    sa = (to_blocks(a0, layout, block) if mode == "dsd" else a0).to(dtype).requires_grad_()
    sb = (to_blocks(b0, layout, block) if mode == "dds" else b0).to(dtype).requires_grad_()
    out = MatMul(layout, block, mode, trans_a=ta, trans_b=tb)(sa, sb)
    out.backward((to_blocks(dy, layout, block) if mode == "sdd" else dy).to(dtype))
    assert out.dtype == dtype and out.shape == ref_y.shape
    close(out, ref_y)
    close(sa.grad, ref_da)
    close(sb.grad, ref_db)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sdd", "dsd", "dds"])
@pytest.mark.parametrize("ta, tb", [(False, False), (True, False), (False, True), (True, True)])
def test_matmul_forward_and_backward_equal_dense_masked_torch(mode: str, ta: bool, tb: bool) -> None:
    _matmul_case(mode, ta, tb, 16, torch.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sdd", "dsd", "dds"])
@pytest.mark.parametrize("block", [32, 64])
def test_matmul_at_larger_blocks(mode: str, block: int) -> None:
    _matmul_case(mode, False, False, block, torch.float32)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["sdd", "dsd", "dds"])
def test_matmul_in_half_precision(mode: str, dtype: torch.dtype) -> None:
    _matmul_case(mode, False, mode == "sdd", 16, dtype)


def _softmax_case(block: int, dtype: torch.dtype, with_masks: bool) -> None:
    z, h, length, scale = 2, 3, 6 * block, 0.4
    layout = random_layout(h, length // block, length // block, seed=block)
    layout[:, range(length // block), range(length // block)] = 1  # every row keeps a tile
    g = torch.Generator().manual_seed(2)
    x0, dy = torch.randn(z, h, length, length, generator=g), torch.randn(z, h, length, length, generator=g)
    rpe = torch.randn(z, h, length, length, generator=g).to(dtype).float() if with_masks else None
    x0, dy = x0.to(dtype).float(), dy.to(dtype).float()
    kp = torch.zeros(z, length)
    kp[:, -3:] = float("-inf")  # the last keys are padding (added)
    attn = (torch.rand(length, length, generator=g) < 0.7).float()
    attn.fill_diagonal_(1.0)  # 0 = masked (multiplied)
    x = x0.clone().requires_grad_()
    logits = x * scale
    if with_masks:
        logits = logits + rpe + kp[:, None, None, :] + torch.where(attn == 0, float("-inf"), 0.0)
    y = torch.softmax(masked(logits, layout, block, float("-inf")), -1)
    y.backward(dy)
    leaf = to_blocks(x0, layout, block).to(dtype).requires_grad_()
    blocks = leaf.clone()  # the op works in place, so not on a leaf
    extra = {"rpe": rpe.to(dtype), "key_padding_mask": kp.to(dtype), "attn_mask": attn.to(dtype),
             "key_padding_mask_mode": "add", "attn_mask_mode": "mul"} if with_masks else {}
    out = Softmax(layout, block)(blocks, scale=scale, **extra)
    assert out is blocks  # DeepSpeed's contract: the result is the input tensor
    out.backward(to_blocks(dy, layout, block).to(dtype))
    close(out, to_blocks(y.detach(), layout, block))
    close(leaf.grad, to_blocks(x.grad, layout, block))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("with_masks", [False, True])
def test_softmax_forward_and_backward_equal_dense_masked_torch(block: int, with_masks: bool) -> None:
    _softmax_case(block, torch.float32, with_masks)


@pytest.mark.timeout(60)
def test_softmax_in_bf16() -> None:
    _softmax_case(16, torch.bfloat16, True)


@pytest.mark.timeout(30)
def test_fewer_dimensions_and_a_2d_layout_as_deepspeed() -> None:
    layout = torch.tensor([[1, 0], [1, 1]])
    a, b = torch.randn(32, 16), torch.randn(16, 32)
    out = MatMul(layout, 16, "sdd")(a, b)
    assert out.shape == (3, 16, 16)  # leading dims the inputs lacked are dropped again
    torch.testing.assert_close(out, to_blocks((a @ b)[None, None], layout[None], 16)[0])


@pytest.mark.timeout(30)
def test_mismatched_inputs_fail_in_one_line() -> None:
    layout = torch.ones(2, 2, 2, dtype=torch.long)
    op = MatMul(layout, 16, "dsd")
    with pytest.raises(SparsityConfigError, match=r"block-sparse A must be \[batch, 8, 16, 16\]"):
        op(torch.randn(1, 7, 16, 16), torch.randn(1, 2, 32, 8))
    with pytest.raises(SparsityConfigError, match="B inner size 31"):
        op(torch.randn(1, 8, 16, 16), torch.randn(1, 2, 31, 8))
    with pytest.raises(SparsityConfigError, match="different dtypes"):
        op(torch.randn(1, 8, 16, 16), torch.randn(1, 2, 32, 8, dtype=torch.float64))
    with pytest.raises(SparsityConfigError, match="mode='xyz'"):
        MatMul(layout, 16, "xyz")
    with pytest.raises(SparsityConfigError, match="attention mask must be torch.float32"):
        Softmax(layout, 16)(torch.randn(1, 8, 16, 16), attn_mask=torch.ones(32, 32, dtype=torch.bool))


class _Largest(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.timeout(60)
def test_memory_follows_the_kept_tiles_not_the_dense_square() -> None:
    # a causal sliding window of 3 blocks over 2048 tokens: 2.3% of the square is kept
    z, h, length, d, block = 1, 2, 2048, 32, 16
    nb = length // block
    layout = torch.zeros(h, nb, nb, dtype=torch.long)
    for i in range(nb):
        layout[:, i, max(0, i - 2):i + 1] = 1
    q, k, v = (torch.randn(z, h, length, d, requires_grad=True) for _ in range(3))
    scores, context, softmax = MatMul(layout, block, "sdd", trans_b=True), MatMul(layout, block, "dsd"), \
        Softmax(layout, block)
    with _Largest() as seen:
        out = context(softmax(scores(q, k), scale=d ** -0.5), v)
        out.sum().backward()
    square = z * h * length * length
    kept = z * int(layout.sum()) * block * block
    assert kept < square / 40
    # the largest tensor is a dense input/output ([Z, H, L, d]), the tiles, or the rows of an operand
    # gathered for them (kept tiles x d / block, rows padded to their block row's longest): not the square
    gathered = 2 * kept * max(block, d) // block
    assert seen.largest <= max(gathered, z * h * length * d) and seen.largest < square / 16, (seen.largest, kept)


@pytest.mark.timeout(30)
def test_deepspeed_paths_name_the_ops() -> None:
    assert ds_matmul.MatMul is MatMul and ds_softmax.Softmax is Softmax
