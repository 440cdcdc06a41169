"""On a CUDA device: the block-sparse Triton products compiled for it, sparse self-attention through
the dispatch point, and DeepSpeed's fused BERT layer (``DeepSpeedTransformerLayer``), each against
a float64 reference on the CPU (the CPU suite checks the same code interpreted or in torch:
``tests/kernels/triton/test_block_sparse.py``, ``tests/runtime/sparse_attention``,
``tests/kernels/test_transformer_layer.py``). Marked ``gpu``: skipped without a CUDA device;
``scripts/gpu/check.sh`` runs them on a lent GPU.

The checks are functions of the device, so that the same code can be run interpreted on CPU
(``TRITON_INTERPRET=1``, ``check_*(torch.device("cpu"), ...)``) when it changes.
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.block_sparse import format as reference
from dslaunch.kernels.transformer import DeepSpeedTransformerLayer
from dslaunch.kernels.transformer_config import DeepSpeedTransformerConfig
from dslaunch.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention
from tests.gpu.marks import COMPILED_TRITON, NEEDS_CUDA
from tests.kernels.bert_reference import ReferenceBertLayer
from tests.kernels.triton.interpret import max_error
from tests.runtime.sparse_attention.test_attention import dense_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(180),
    NEEDS_CUDA,
    COMPILED_TRITON,
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative to max(1, max |reference|), against float64: fp32 allows the accumulation order of a
# K-long dot product; bf16/fp16 eight ulps of the output (inputs are rounded too, products are fp32).
TOLERANCE = {torch.float32: 5e-5, torch.float16: 8 * 2.0**-11, torch.bfloat16: 8 * 2.0**-8}
CUDA = torch.device("cuda")


def check_block_sparse_products(device: torch.device, dtype: torch.dtype, block: int) -> None:
    """sdd (strided operand) and spmm (plain and transposed) of the Triton module against the torch
    reference in float64; an empty block row gives zeros."""
    from dslaunch.kernels.triton import block_sparse

    g = torch.Generator().manual_seed(block)
    layout = (torch.rand(2, 3, 4, generator=g) < 0.5).long()
    layout[0, 1] = 0  # an empty block row
    lay = reference.BlockLayout(layout, block)
    z, k, n = 2, 72, 100  # not multiples of the kernels' steps
    a = torch.randn(z, 2, 3 * block, k, generator=g)
    b = torch.randn(z, 2, 4 * block, k, generator=g).transpose(-1, -2)
    got = block_sparse.sdd(a.to(device, dtype), b.to(device, dtype), lay)
    want = reference.sdd(a.to(dtype).double(), b.to(dtype).double(), lay)
    assert got.dtype == dtype and max_error(got.cpu(), want) <= TOLERANCE[dtype], max_error(got.cpu(), want)
    s = torch.randn(z, lay.nnz, block, block, generator=g)
    for transposed, rows in ((False, 4), (True, 3)):
        d = torch.randn(z, 2, rows * block, n, generator=g)
        got = block_sparse.spmm(s.to(device, dtype), transposed, d.to(device, dtype), lay)
        want = reference.spmm(s.to(dtype).double(), transposed, d.to(dtype).double(), lay)
        assert got.dtype == dtype and max_error(got.cpu(), want) <= TOLERANCE[dtype], (transposed, max_error(got.cpu(), want))
        if not transposed:
            assert got[:, 0, block:2 * block].eq(0).all()


def check_sparse_self_attention(device: torch.device, dtype: torch.dtype, block: int) -> None:
    """SparseSelfAttention (a fixed causal layout, a key padding mask) forward and the q/k/v
    gradients against dense masked attention in float64."""
    torch.manual_seed(block)
    heads, seq, dim = 4, 8 * block, 64
    cfg = FixedSparsityConfig(heads, block=block, num_local_blocks=2, attention="unidirectional")
    module = SparseSelfAttention(cfg, max_seq_length=seq).to(device)
    q, k, v = (torch.randn(2, heads, seq, dim) for _ in range(3))
    kp = torch.zeros(2, 1, 1, seq)
    kp[1, ..., -5:] = -10000.0
    ins = [t.to(device, dtype).requires_grad_() for t in (q, k, v)]
    out = module(*ins, key_padding_mask=kp.to(device, dtype))
    grads = torch.autograd.grad(out, ins, torch.ones_like(out))
    ref_ins = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
    ref = dense_attention(*ref_ins, cfg.make_layout(seq), block, kp.double())
    ref_grads = torch.autograd.grad(ref, ref_ins, torch.ones_like(ref))
    tol = 2 * TOLERANCE[dtype]  # two products and a softmax (measured on CPU: 8-20x below)
    assert out.dtype == dtype and max_error(out.cpu(), ref) <= tol, max_error(out.cpu(), ref)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert max_error(got.cpu(), want) <= tol, (name, max_error(got.cpu(), want))


def check_fused_layer(device: torch.device, dtype: torch.dtype, pre_ln: bool) -> None:
    """Two DeepSpeedTransformerLayers against the plain-torch BERT layer in float64: output, input
    gradient and every parameter gradient, with a padding mask."""
    torch.manual_seed(0)
    batch, seq, hidden = 4, 64, 256
    cfg = DeepSpeedTransformerConfig(batch_size=batch, hidden_size=hidden, intermediate_size=4 * hidden, heads=8,
                                     attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, num_hidden_layers=2,
                                     initializer_range=0.02, pre_layer_norm=pre_ln, fp16=dtype == torch.float16)
    stack = torch.nn.ModuleList(DeepSpeedTransformerLayer(cfg) for _ in range(2))
    with torch.no_grad():
        for p in stack.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    stack = stack.to(dtype)  # the reference gets the same rounded weights
    refs = torch.nn.ModuleList(ReferenceBertLayer.copy_of(layer) for layer in stack).double()
    stack = stack.to(device)
    mask = torch.zeros(batch, 1, 1, seq)
    mask[1, ..., 40:] = -10000.0
    x = torch.randn(batch, seq, hidden)
    dy = torch.randn(batch, seq, hidden)

    def run(layers, x, mask, dy):  # noqa: ANN001, ANN202
        x = x.clone().requires_grad_()
        y = x
        for layer in layers:
            y = layer(y, mask)
        (y * dy).sum().backward()
        return y.detach(), x.grad

    out, dx = run(stack, x.to(device, dtype), mask.to(device, dtype), dy.to(device, dtype))
    ref_out, ref_dx = run(refs, x.to(dtype).double(), mask.double(), dy.to(dtype).double())
    tol = 4 * TOLERANCE[dtype]  # two layers of products, softmax and norms (measured on CPU: 7-10x below)
    assert out.dtype == dtype and max_error(out.cpu(), ref_out) <= tol, max_error(out.cpu(), ref_out)
    assert max_error(dx.cpu(), ref_dx) <= tol, max_error(dx.cpu(), ref_dx)
    for layer, ref in zip(stack, refs, strict=True):
        for name, grad in ref.grads_as_ds().items():
            got = getattr(layer, name).grad
            assert max_error(got.cpu(), grad) <= tol, (name, max_error(got.cpu(), grad))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 32, 64])
def test_block_sparse_products(dtype: torch.dtype, block: int) -> None:
    check_block_sparse_products(CUDA, dtype, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [16, 64])
def test_sparse_self_attention(dtype: torch.dtype, block: int) -> None:
    check_sparse_self_attention(CUDA, dtype, block)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pre_ln", [True, False])
def test_fused_transformer_layer(dtype: torch.dtype, pre_ln: bool) -> None:
    check_fused_layer(CUDA, dtype, pre_ln)
