"""Where the Triton kernels are not available (no triton, or no CUDA device as on the test
machines), the package still imports and the dispatch point picks the torch reference on CUDA;
``DSLAUNCH_KERNELS=fused`` then fails clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from dslaunch.errors import UsageError
from dslaunch.kernels import dispatch

OPS = ("adam", "layer_norm", "rms_norm", "bias_gelu")

_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` raises ImportError, find_spec finds nothing
import torch
import dslaunch.kernels.triton as t
from dslaunch.kernels import dispatch
from dslaunch.ops.normalization import FusedLayerNorm
assert not t.available()
for op in {ops}:
    assert dispatch.KERNELS.get(op, "cuda") is dispatch.KERNELS.get(op, "cuda", "reference"), op
x = torch.randn(3, 8)
assert torch.equal(FusedLayerNorm(8)(x), torch.nn.LayerNorm(8)(x))
assert "triton" not in [m for m, v in sys.modules.items() if v is not None]
print("ok")
"""


@pytest.mark.timeout(60)
def test_without_triton_the_package_imports_and_the_reference_runs() -> None:
    out = subprocess.run([sys.executable, "-c", _WITHOUT_TRITON.format(ops=OPS)], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there: the Triton kernels are picked")
def test_without_cuda_the_reference_is_picked_and_fused_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DSLAUNCH_KERNELS", raising=False)
    for op in OPS:
        kernels = dispatch.KERNELS.fused[op]
        assert any(k.device_types == ("cuda",) and "kernels.triton" in str(k.target) for k in kernels), op
        assert dispatch.get(op, "cuda") is dispatch.KERNELS.get(op, "cuda", "reference")
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")
    with pytest.raises(UsageError, match="no fused 'layer_norm' kernel runs on 'cuda' here"):
        dispatch.get("layer_norm", "cuda:0")
