"""The Triton bias + GeLU (+ dropout) (interpreted, CPU tensors) against torch in fp64: output,
input and bias gradients for both approximations, sizes 0 and 1, odd sizes, sizes that are not a
multiple of the block, non-contiguous inputs, fp32/bf16/fp16; the seeded dropout's determinism, its
keep rate and a backward consistent with the forward's mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.triton.interpret import TOLERANCE, kernel_module, max_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape[::-1] if transposed else shape, generator=g) * 3
    x = x.transpose(0, -1) if transposed else x
    return x.to(dtype).requires_grad_(), torch.randn(shape[-1], generator=g).to(dtype).requires_grad_()


def _grads(y: torch.Tensor, inputs: list[torch.Tensor], dy: torch.Tensor) -> list[torch.Tensor]:
    return [y, *torch.autograd.grad(y, inputs, dy)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape, transposed", [
    ((0, 5), False), ((1, 1), False), ((3, 2, 33), False), ((3, 700), False), ((9, 31), True),
])
def test_against_torch(shape: tuple[int, ...], transposed: bool, approximate: str, dtype: torch.dtype) -> None:
    module = kernel_module("bias_gelu")
    x, b = _inputs(shape, dtype, transposed)
    dy = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = _grads(module.bias_gelu(x, b, approximate), [x, b], dy)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    want = _grads(F.gelu(x64 + b64, approximate=approximate), [x64, b64], dy.double())
    for name, a, w in zip(["y", "dx", "dbias"], got, want, strict=True):
        assert a.dtype == dtype and max_error(a, w) <= TOLERANCE[dtype], f"{name}: {max_error(a, w)}"


def test_extreme_inputs_saturate() -> None:
    module = kernel_module("bias_gelu")
    x = torch.tensor([[-1e4, -30.0, 0.0, 30.0, 1e4]], requires_grad=True)
    for approximate in ("none", "tanh"):
        y = module.bias_gelu(x, torch.zeros(5), approximate)
        (dx,) = torch.autograd.grad(y, [x], torch.ones_like(y))
        assert torch.equal(y.detach(), torch.tensor([[0.0, 0.0, 0.0, 30.0, 1e4]])), y
        assert torch.allclose(dx, torch.tensor([[0.0, 0.0, 0.5, 1.0, 1.0]])), dx


def test_dropout_is_seeded_and_the_backward_uses_the_forwards_mask() -> None:
    module = kernel_module("bias_gelu")
    p = 0.3
    x, b = _inputs((64, 33), torch.float32, False)
    y = module.bias_gelu(x, b, "tanh", p, seed=7)
    assert torch.equal(y, module.bias_gelu(x, b, "tanh", p, seed=7))
    assert not torch.equal(y, module.bias_gelu(x, b, "tanh", p, seed=8))
    keep = y != 0  # gelu(x + b) is nonzero for every element of these inputs
    assert abs(keep.float().mean().item() - (1 - p)) < 0.05  # 2112 draws: sigma ~0.01
    plain = F.gelu(x + b, approximate="tanh")
    assert max_error(y[keep], plain[keep] / (1 - p)) <= TOLERANCE[torch.float32]
    dy = torch.randn(64, 33)
    dx, db = torch.autograd.grad(y, [x, b], dy)
    want_dx = torch.autograd.grad(plain, [x], dy)[0] * keep / (1 - p)
    assert max_error(dx, want_dx) <= TOLERANCE[torch.float32]
    assert max_error(db, want_dx.sum(0)) <= TOLERANCE[torch.float32]
    assert max_error(module.bias_gelu(x, b, "tanh", p, training=False), plain) <= TOLERANCE[torch.float32]


def test_bad_arguments_are_refused() -> None:
    module = kernel_module("bias_gelu")
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh', not 'fast'"):
        module.bias_gelu(x, torch.zeros(3), "fast")
    with pytest.raises(ValueError, match=r"dropout probability must be in \[0, 1\), not 1.0"):
        module.bias_gelu(x, torch.zeros(3), p=1.0)
    with pytest.raises(ValueError, match=r"bias of shape \[2\] does not match the input's trailing dims \[2, 3\]"):
        module.bias_gelu(x, torch.zeros(2))
