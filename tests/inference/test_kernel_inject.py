"""Kernel injection swaps in the fused modules only where a probe shows the same outputs (checked
on CPU, where the fused modules run torch's reference ops; on CUDA they run the Triton kernels)."""

from __future__ import annotations

import torch
from torch import nn

from dslaunch.ops.bias_gelu import BiasGeLU
from dslaunch.ops.normalization import FusedLayerNorm, FusedRMSNorm
from dslaunch.runtime.inference.kernel_inject import inject_kernels
from tests.inference.models import GeluMLP, tiny_lm


class OnePlusRMSNorm(nn.Module):
    """Gemma's RMSNorm (scales by 1 + weight): looks like an RMSNorm, computes something else."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.randn(dim)), 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight)


def test_norms_and_bias_gelu_are_replaced_where_outputs_match() -> None:
    ids = torch.tensor([[1, 2, 3, 4]])
    model = tiny_lm()
    model.blocks[1].norm2 = OnePlusRMSNorm(48)
    with torch.no_grad():
        want = model(ids)
        replaced = inject_kernels(model)
        got = model(ids)
    assert isinstance(model.blocks[0].norm1, FusedLayerNorm) and isinstance(model.blocks[0].norm2, FusedRMSNorm)
    assert isinstance(model.blocks[1].norm2, OnePlusRMSNorm)  # the probe told it apart: left alone
    assert "blocks.1.norm2" not in replaced
    assert torch.allclose(got, want, atol=1e-6)

    mlp = GeluMLP().eval()
    with torch.no_grad():
        want = mlp(ids)
        assert set(inject_kernels(mlp)) == {"norm", "act"}
        got = mlp(ids)
    assert isinstance(mlp.act, BiasGeLU) and mlp.act.approximate == "tanh" and mlp.fc.bias is None
    assert isinstance(mlp.other, nn.SiLU)  # not a GeLU
    assert torch.allclose(got, want, atol=1e-6)
