"""``dslaunch.ops.bias_gelu`` on CPU (the torch reference): gelu(x + bias) with either
approximation, seeded dropout, argument checks; ``BiasGeLU`` owns its bias."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dslaunch.ops.bias_gelu import BiasGeLU, bias_gelu


@pytest.mark.timeout(30)
def test_reference_bias_gelu() -> None:
    x, b = torch.randn(64, 33), torch.randn(33)
    for approximate in ("none", "tanh"):
        assert torch.equal(bias_gelu(x, b, approximate), F.gelu(x + b, approximate=approximate))
    y = bias_gelu(x, b, p=0.25, seed=3)
    assert torch.equal(y, bias_gelu(x, b, p=0.25, seed=3)) and not torch.equal(y, bias_gelu(x, b, p=0.25, seed=4))
    keep = y != 0
    assert abs(keep.float().mean().item() - 0.75) < 0.05
    assert torch.allclose(y[keep], F.gelu(x + b)[keep] / 0.75)
    assert torch.equal(bias_gelu(x, b, p=0.25, training=False), F.gelu(x + b))
    with pytest.raises(ValueError, match="approximate must be 'none' or 'tanh'"):
        bias_gelu(x, b, "exact")


@pytest.mark.timeout(30)
def test_the_module_trains_its_bias_and_drops_only_in_training() -> None:
    m = BiasGeLU(8, approximate="tanh", p=0.5)
    x = torch.randn(16, 8)
    m(x).sum().backward()
    assert m.bias.grad is not None and m.bias.grad.abs().sum() > 0
    m.eval()
    assert torch.equal(m(x), F.gelu(x, approximate="tanh"))
