"""``dslaunch.ops.normalization`` on CPU (the torch reference; the Triton kernels are tested in
tests/kernels/triton): drop-in for torch's modules, same ``state_dict``, through the dispatch point."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels import dispatch
from dslaunch.kernels.dispatch import Kernel, KernelTable
from dslaunch.ops.normalization import FUSED_MIN_FEATURES, FusedLayerNorm, FusedRMSNorm, layer_norm, rms_norm


@pytest.mark.timeout(30)
def test_the_modules_are_torchs() -> None:
    x = torch.randn(4, 3, 6)
    for ours, theirs in ((FusedLayerNorm((3, 6), eps=1e-4), torch.nn.LayerNorm((3, 6), eps=1e-4)),
                         (FusedRMSNorm(6), torch.nn.RMSNorm(6)), (FusedLayerNorm(6, bias=False), torch.nn.LayerNorm(6, bias=False))):
        torch.nn.init.normal_(theirs.weight)
        ours.load_state_dict(theirs.state_dict())
        assert torch.equal(ours(x), theirs(x))
    assert torch.equal(layer_norm(x, None, None, 1e-5, normalized_shape=(6,)), torch.nn.functional.layer_norm(x, (6,)))
    assert torch.equal(rms_norm(x, torch.ones(6)), torch.nn.functional.rms_norm(x, (6,), torch.ones(6)))


@pytest.mark.timeout(30)
def test_the_modules_call_the_dispatch_point(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def spy(op: str):
        def fused(*args):
            calls.append(op)
            return dispatch.KERNELS.get(op, "cpu", "reference")(*args)
        return fused

    table = KernelTable(dispatch.KERNELS.reference, {op: (Kernel(spy(op), ("cpu",)),) for op in ("layer_norm", "rms_norm")})
    monkeypatch.setattr(dispatch, "KERNELS", table)
    narrow, wide = FUSED_MIN_FEATURES - 1, FUSED_MIN_FEATURES
    FusedLayerNorm(narrow)(torch.randn(2, narrow))  # narrow rows: torch's kernel, not the dispatch point
    FusedRMSNorm(narrow, eps=None)(torch.randn(2, narrow))
    assert calls == []
    FusedLayerNorm(wide)(torch.randn(2, wide))
    FusedRMSNorm(wide, eps=None)(torch.randn(2, wide))
    assert calls == ["layer_norm", "rms_norm"]
