"""The flops profiler on a CUDA device: autograd runs the backward on its device thread there, so
the counter's attribution (by the recorded thread ids and autograd sequence numbers) is checked
against the same model on the CPU: every module's forward and backward count equal. Marked ``gpu``.
"""

from __future__ import annotations

import pytest
import torch

from dslaunch.profiling.flops_profiler import FlopsProfiler
from tests.gpu.marks import NEEDS_CUDA
from tests.profiling.flops_profiler.gpt import GPT

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    NEEDS_CUDA,
]

B, T = 3, 16


def _rows(device: str) -> dict[str, tuple[int, int]]:
    torch.manual_seed(0)
    model = GPT(impl="matmul", seq=T).to(device)
    tokens = torch.randint(0, 64, (B, T), device=device)
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(tokens, tokens).backward()
    if device == "cuda":
        torch.cuda.synchronize()
    prof.stop_profile()
    p = prof.profile()
    rows = {r.name: (r.fwd_flops, r.bwd_flops) for r in p.rows}
    rows["(total)"] = (p.fwd_flops, p.bwd_flops)
    return rows


def test_cuda_backward_is_attributed_to_the_modules_as_on_cpu() -> None:
    cpu, cuda = _rows("cpu"), _rows("cuda")
    assert cuda == cpu
    # the matmul modules' backward is twice their forward (dX and dW), wherever autograd ran it
    assert all(bwd == 2 * fwd > 0 for name, (fwd, bwd) in cuda.items() if name.endswith((".qkv", ".proj", "head")))
