"""The Triton per-row cross-entropy (interpreted, CPU tensors) against torch in fp64: loss and
logits gradient for fp32/bf16/fp16, no rows, one row, vocabularies under and over one block
(1024 columns), ignored rows, extreme logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.triton.interpret import TOLERANCE, kernel_module, max_error

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
IGNORE = -100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(0, 5), (1, 1), (3, 7), (4, 1500)])
def test_against_torch(rows: int, vocab: int, dtype: torch.dtype) -> None:
    module = kernel_module("cross_entropy")
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype).requires_grad_()
    target = torch.randint(0, vocab, (rows,), generator=g)
    if rows > 2:
        target[1] = IGNORE
    scale = torch.randn(rows, generator=g)
    loss = module.cross_entropy_rows(logits, target, IGNORE)
    (dx,) = torch.autograd.grad(loss, [logits], scale)
    x64 = logits.detach().double().requires_grad_()
    want = F.cross_entropy(x64, target, ignore_index=IGNORE, reduction="none")
    (dx64,) = torch.autograd.grad(want, [x64], scale.double())
    assert loss.dtype == torch.float32 and max_error(loss, want) <= TOLERANCE[torch.float32]
    assert dx.dtype == dtype and max_error(dx, dx64) <= TOLERANCE[dtype], max_error(dx, dx64)


def test_extreme_logits_stay_finite() -> None:
    module = kernel_module("cross_entropy")
    logits = torch.tensor([[1e4, -1e4, 0.0], [-3e38, 0.0, 3e38]], requires_grad=True)
    target = torch.tensor([0, 1])
    loss = module.cross_entropy_rows(logits, target)
    (dx,) = torch.autograd.grad(loss.sum(), [logits])
    assert torch.equal(loss.detach(), torch.tensor([0.0, 3e38])), loss
    assert torch.isfinite(dx).all() and torch.equal(dx, torch.tensor([[0.0, 0.0, 0.0], [0.0, -1.0, 1.0]])), dx
