"""The fused offloaded steps (Adam, Adagrad, Lion) against the same sequence in torch ops: unscale,
overflow check, global norm, clip, the update, 16-bit copy; an overflow leaves everything untouched."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from dslaunch.kernels.cpu import build
from dslaunch.kernels.cpu.offload import offload_adagrad_step, offload_adam_step, offload_lion_step
from dslaunch.kernels.reference import lion_update

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler")

SCALE = 1024.0


@dataclass(frozen=True)
class Case:
    """One optimizer: its fused step, its number of fp32 states, and torch's step on fp32 grads."""

    fused: Callable[..., object]  # (masters, grads, *states, step=, **kw) -> OffloadStepResult
    n_states: int
    reference: Callable[[list[torch.nn.Parameter]], Callable[[list[torch.Tensor]], None]]


def _torch_optimizer(cls, **kw):
    def make(params):
        opt = cls(params, fused=True, **kw)

        def step(grads):
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            opt.step()
        return step
    return make


def _lion_reference(params):
    states = [torch.zeros_like(p) for p in params]
    return lambda grads: lion_update([p.data for p in params], grads, states, lr=1e-2, betas=(0.9, 0.99),
                                     weight_decay=0.1, inv_scale=None)


CASES = {
    "adam": Case(lambda ms, gs, *st, step, **kw: offload_adam_step(ms, gs, *st, step=step, lr=1e-2,
                                                                   weight_decay=0.1, **kw),
                 2, _torch_optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)),
    "adagrad": Case(lambda ms, gs, *st, step, **kw: offload_adagrad_step(ms, gs, *st, lr=1e-1, weight_decay=0.1,
                                                                         **kw),
                    1, _torch_optimizer(torch.optim.Adagrad, lr=1e-1, weight_decay=0.1)),
    "lion": Case(lambda ms, gs, *st, step, **kw: offload_lion_step(ms, gs, *st, lr=1e-2, betas=(0.9, 0.99),
                                                                   weight_decay=0.1, **kw),
                 1, _lion_reference),
}


def _torch_sequence(grads16, ref_step, max_norm):
    """What an unfused offloaded step does, op by op. The norm is summed in double, as the kernel
    does: an fp32 norm is off by ~3e-6 relative at 65k elements, which Adagrad's update (a tiny
    first sum of squares) amplifies past 1e-6."""
    grads = [g.float() / SCALE for g in grads16]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    coef = min(1.0, max_norm / (float(norm) + 1e-6)) if max_norm > 0 else 1.0
    ref_step([g * coef for g in grads])
    return float(norm)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("max_norm", [0.0, 50.0])
# 0, 1, around the AVX2 width (8) and its 16-byte tail, odd, and above the one-thread cut-off.
@pytest.mark.parametrize("sizes", [[0, 1, 7, 8, 9, 17], [4099], [(1 << 16) + 9]])
def test_matches_the_torch_sequence(name, dtype, max_norm, sizes) -> None:
    case = CASES[name]
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, generator=gen) for n in sizes]
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    ref_step = case.reference(ref)
    states = [[torch.zeros(n) for n in sizes] for _ in range(case.n_states)]
    copies = None if dtype == torch.float32 else [torch.empty(n, dtype=dtype) for n in sizes]
    for t in range(1, 4):
        grads = [(torch.randn(n, generator=gen) * SCALE).to(dtype) for n in sizes]
        want_norm = _torch_sequence(grads, ref_step, max_norm)
        got = case.fused(masters, grads, *states, step=t, loss_scale=SCALE, max_grad_norm=max_norm, copies=copies)
        assert not got.overflow and got.grad_norm == pytest.approx(want_norm, rel=1e-5)
        assert (got.clip_coef < 1.0) == (0 < max_norm < want_norm)
    for m, r in zip(masters, ref, strict=True):
        assert torch.allclose(m, r, rtol=0, atol=1e-6)
    for c, m in zip(copies or [], masters[:len(copies or [])], strict=True):
        assert torch.equal(c, m.to(dtype))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_overflow_is_detected_and_nothing_is_updated(name, bad, dtype) -> None:
    case = CASES[name]
    masters = [torch.randn(5), torch.randn(70001)]
    grads = [torch.randn(5).to(dtype), torch.randn(70001).to(dtype)]
    grads[1][-3] = bad  # in the second partition, near its end: after the vector loop's body
    states = [[torch.ones(5), torch.ones(70001)] for _ in range(case.n_states)]
    copies = [torch.zeros(5, dtype=dtype), torch.zeros(70001, dtype=dtype)]
    everything = masters + [s for st in states for s in st] + copies
    before = [t.clone() for t in everything]
    got = case.fused(masters, grads, *states, step=1, loss_scale=SCALE, max_grad_norm=1.0, copies=copies)
    assert got.overflow and not torch.isfinite(torch.tensor(got.grad_norm))
    assert all(torch.equal(a, b) for a, b in zip(everything, before, strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", CASES)
def test_the_norm_is_reduced_over_ranks_before_clipping(name) -> None:
    # Two "ranks" in one process: each calls with its partition and an all_reduce that adds the
    # other's sum of squares; the result equals one call over both partitions.
    case = CASES[name]
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(1000, generator=gen) for _ in range(2)]
    grads = [torch.randn(1000, generator=gen) * SCALE for _ in range(2)]
    whole = [p.clone() for p in parts]
    kw = {"step": 1, "loss_scale": SCALE, "max_grad_norm": 1.0}
    one = case.fused(whole, grads, *[[torch.zeros(1000) for _ in range(2)] for _ in range(case.n_states)], **kw)
    sums = [float((g / SCALE).double().square().sum()) for g in grads]
    for rank in range(2):
        got = case.fused([parts[rank]], [grads[rank]], *[[torch.zeros(1000)] for _ in range(case.n_states)],
                         all_reduce=lambda s, r=rank: s + sums[1 - r], **kw)
        assert got.grad_norm == pytest.approx(one.grad_norm, rel=1e-12)
        assert torch.allclose(parts[rank], whole[rank], rtol=0, atol=1e-7)
