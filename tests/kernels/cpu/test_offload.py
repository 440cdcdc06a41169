"""The fused offloaded step against the same sequence in torch ops: unscale, overflow check,
global norm, clip, AdamW, 16-bit copy; an overflow leaves everything untouched."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.cpu import build
from dslaunch.kernels.cpu.offload import offload_adam_step

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler")

SCALE = 1024.0


def _torch_sequence(params, grads16, opt, max_norm):
    """What an unfused offloaded step does, op by op."""
    grads = [g.float() / SCALE for g in grads16]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = min(1.0, max_norm / (float(norm) + 1e-6)) if max_norm > 0 else 1.0
    for p, g in zip(params, grads, strict=True):
        p.grad = g * coef
    opt.step()
    return float(norm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("max_norm", [0.0, 50.0])
@pytest.mark.parametrize("sizes", [[0, 1], [7, 4099], [(1 << 16) + 9]])
def test_matches_the_torch_sequence(dtype, max_norm, sizes) -> None:
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in sizes]
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    ms, vs = [torch.zeros(n) for n in sizes], [torch.zeros(n) for n in sizes]
    copies = None if dtype == torch.float32 else [torch.empty(n, dtype=dtype) for n in sizes]
    for t in range(1, 4):
        grads = [(torch.randn(n, generator=gen) * SCALE).to(dtype) for n in sizes]
        want_norm = _torch_sequence(ref, grads, opt, max_norm)
        got = offload_adam_step(masters, grads, ms, vs, step=t, lr=1e-2, weight_decay=0.1, loss_scale=SCALE,
                                max_grad_norm=max_norm, copies=copies)
        assert not got.overflow and got.grad_norm == pytest.approx(want_norm, rel=1e-5)
        assert (got.clip_coef < 1.0) == (0 < max_norm < want_norm)
    for m, r in zip(masters, ref, strict=True):
        assert torch.allclose(m, r, rtol=0, atol=1e-6)
    for c, m in zip(copies or [], masters[:len(copies or [])], strict=True):
        assert torch.equal(c, m.to(dtype))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_overflow_is_detected_and_nothing_is_updated(bad, dtype) -> None:
    masters = [torch.randn(5), torch.randn(70001)]
    grads = [torch.randn(5).to(dtype), torch.randn(70001).to(dtype)]
    grads[1][-3] = bad  # in the second partition, near its end: after the vector loop's body
    ms, vs = [torch.ones(5), torch.ones(70001)], [torch.ones(5), torch.ones(70001)]
    copies = [torch.zeros(5, dtype=dtype), torch.zeros(70001, dtype=dtype)]
    before = [t.clone() for t in masters + ms + vs + copies]
    got = offload_adam_step(masters, grads, ms, vs, step=1, lr=1e-2, loss_scale=SCALE, max_grad_norm=1.0,
                            copies=copies)
    assert got.overflow and not torch.isfinite(torch.tensor(got.grad_norm))
    assert all(torch.equal(a, b) for a, b in zip(masters + ms + vs + copies, before, strict=True))


@pytest.mark.timeout(30)
def test_the_norm_is_reduced_over_ranks_before_clipping() -> None:
    # Two "ranks" in one process: each calls with its partition and an all_reduce that adds the
    # other's sum of squares; the result equals one call over both partitions.
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1000, generator=gen) for _ in range(2)]
    grads = [torch.randn(1000, generator=gen) * SCALE for _ in range(2)]
    whole = [p.clone() for p in parts]
    kw = {"step": 1, "lr": 1e-2, "loss_scale": SCALE, "max_grad_norm": 1.0}
    one = offload_adam_step(whole, grads, [torch.zeros(1000) for _ in range(2)],
                            [torch.zeros(1000) for _ in range(2)], **kw)
    sums = [float((g / SCALE).double().square().sum()) for g in grads]
    for rank in range(2):
        got = offload_adam_step([parts[rank]], [grads[rank]], [torch.zeros(1000)], [torch.zeros(1000)],
                                all_reduce=lambda s, r=rank: s + sums[1 - r], **kw)
        assert got.grad_norm == pytest.approx(one.grad_norm, rel=1e-12)
        assert torch.allclose(parts[rank], whole[rank], rtol=0, atol=1e-7)
