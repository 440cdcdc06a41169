"""The Triton LayerNorm/RMSNorm (interpreted, CPU tensors) against torch's in fp32: output, input,
weight and bias gradients, for sizes 0 and 1, odd feature counts, non-contiguous inputs and
gradients, fp32/bf16/fp16 (tolerances in ``interpret.TOLERANCE``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.triton.interpret import TOLERANCE, kernel_module, max_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _layouts(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if layout == "transposed":  # the feature dim is strided: the kernel gets a contiguous copy
        return (torch.randn(shape[::-1], generator=g) * 2 + 0.5).to(dtype).transpose(0, -1)
    if layout == "row-strided":  # every other row: rows are read with their stride, no copy
        return (torch.randn((shape[0] * 2, *shape[1:]), generator=g) * 2 + 0.5).to(dtype)[::2]
    return (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype)


def _check(ours, theirs, x: torch.Tensor, params: list[torch.Tensor]) -> None:
    """``ours(x, *params)`` against ``theirs`` on fp64 copies (exact to fp32): output and every gradient."""
    x = x.detach().requires_grad_()
    params = [p.detach().requires_grad_() for p in params]
    y = ours(x, *params)
    dy = torch.randn(y.shape[::-1], generator=torch.Generator().manual_seed(1)).to(y.dtype).transpose(0, -1)
    got = [y, *torch.autograd.grad(y, [x, *params], dy)]
    x64, params64 = x.detach().double().requires_grad_(), [p.detach().double().requires_grad_() for p in params]
    y64 = theirs(x64, *params64)
    want = [y64, *torch.autograd.grad(y64, [x64, *params64], dy.double())]
    for name, a, b in zip(["y", "dx", "dweight", "dbias"], got, want, strict=False):
        assert a.dtype == x.dtype and a.shape == b.shape
        assert max_error(a, b) <= TOLERANCE[x.dtype], f"{name}: {max_error(a, b)}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, layout", [
    ((0, 5), "contiguous"), ((1, 1), "contiguous"), ((5, 7), "contiguous"), ((3, 2, 33), "contiguous"),
    ((2, 3, 130), "row-strided"), ((6, 17), "transposed"),
])
def test_layer_norm(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> None:
    norms = kernel_module("norms")
    x = _layouts(shape, dtype, layout)
    n = shape[-1]
    w, b = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
    _check(lambda x, w, b: norms.layer_norm(x, w, b, 1e-5),
           lambda x, w, b: F.layer_norm(x, (n,), w, b, 1e-5), x, [w, b])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, layout", [
    ((0, 5), "contiguous"), ((1, 1), "contiguous"), ((3, 2, 33), "contiguous"), ((2, 3, 130), "row-strided"),
    ((6, 17), "transposed"),
])
def test_rms_norm(shape: tuple[int, ...], layout: str, dtype: torch.dtype) -> None:
    norms = kernel_module("norms")
    x = _layouts(shape, dtype, layout)
    n = shape[-1]
    _check(lambda x, w: norms.rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (n,), w, 1e-6),
           x, [torch.randn(n).to(dtype)])


def test_without_affine_and_over_two_dims() -> None:
    norms = kernel_module("norms")
    x = _layouts((4, 3, 5), torch.float32, "contiguous")
    _check(lambda x: norms.layer_norm(x, None, None, 1e-5, normalized_shape=(3, 5)),
           lambda x: F.layer_norm(x, (3, 5), None, None, 1e-5), x, [])
    w = torch.randn(3, 5)
    _check(lambda x, w: norms.rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (3, 5), w, 1e-6), x, [w])


def test_bad_shapes_are_refused() -> None:
    norms = kernel_module("norms")
    with pytest.raises(ValueError, match=r"normalized shape \[4\] does not match the input's trailing dims \[2, 3\]"):
        norms.layer_norm(torch.zeros(2, 3), torch.ones(4), None)
    with pytest.raises(ValueError, match="takes up to 65536 features, not 65537; set DSLAUNCH_KERNELS=reference"):
        norms.rms_norm(torch.zeros(1, norms.MAX_N + 1), torch.ones(norms.MAX_N + 1))
