"""The C kernels against torch: several steps within 1e-6 (bit-equal on AVX2 machines, but the
tests only ask 1e-6), odd sizes, both thread counts, 16-bit gradients and copies, AMP scaling."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels.cpu import build, ops
from dslaunch.kernels.cpu.torch_steps import adagrad_step, adam_step
from dslaunch.kernels.reference import adam_update, cpu_adam_update, lion_update

pytestmark = pytest.mark.skipif(not build.available(), reason="no C compiler: the torch reference runs")

# 0, 1, below/at/above the AVX2 width (8), odd, and above the one-thread cut-off (1 << 16).
SIZES = [0, 1, 7, 8, 9, 1023, (1 << 16) + 3]
TOL = 1e-6


def _pair(n: int, seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())


def _grads(n: int, steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=g) for _ in range(steps)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("cls, kwargs, step", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, adam_step),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}, adam_step),  # L2 mode
    (torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-6}, adam_step),
    (torch.optim.Adagrad, {"lr": 1e-1, "weight_decay": 0.1, "lr_decay": 0.01}, adagrad_step),
    (torch.optim.Adagrad, {"lr": 1e-1, "initial_accumulator_value": 0.1}, adagrad_step),
], ids=["adamw", "adam-l2", "adam-betas", "adagrad-decay", "adagrad-init"])
def test_torch_optimizers(n, cls, kwargs, step, threads) -> None:
    ours, theirs = _pair(n)
    ours_opt, torch_opt = cls([ours], **kwargs), cls([theirs], fused=True, **kwargs)
    for g in _grads(n, 5):
        ours.grad, theirs.grad = g.clone(), g.clone()
        step(ours_opt)
        torch_opt.step()
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL)
    for key, value in torch_opt.state[theirs].items():
        assert torch.allclose(ours_opt.state[ours][key], value, rtol=0, atol=TOL), key


# The two Adam ops (torch's rounding, DeepSpeed's) and their references.
ADAM_OPS = [(ops.adam_op, adam_update), (ops.cpu_adam_op, cpu_adam_update)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("op, reference", ADAM_OPS, ids=["adam", "cpu_adam"])
def test_adam_op_against_the_reference(n, bias_correction, adam_w_mode, op, reference, threads) -> None:
    a, b = _pair(n)
    states = [torch.zeros(n) for _ in range(4)]
    for t, g in enumerate(_grads(n, 5), start=1):
        kw = {"step": t, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.05,
              "bias_correction": bias_correction, "adam_w_mode": adam_w_mode, "inv_scale": 0.25}
        op([a.data], [g * 4], states[:1], states[1:2], **kw)
        reference([b.data], [g * 4], states[2:3], states[3:], **kw)
    assert torch.allclose(a, b, rtol=0, atol=TOL)
    assert torch.allclose(states[1], states[3], rtol=0, atol=TOL)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", SIZES)
def test_lion_op_against_the_reference(n, threads) -> None:
    a, b = _pair(n)
    ma, mb = torch.zeros(n), torch.zeros(n)
    for g in _grads(n, 5):
        kw = {"lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.1, "inv_scale": 0.5}
        ops.lion_op([a.data], [g], [ma], **kw)
        lion_update([b.data], [g], [mb], **kw)
    assert torch.allclose(a, b, rtol=0, atol=TOL) and torch.allclose(ma, mb, rtol=0, atol=TOL)


def _adam_fp64_error(association: str, steps: int = 10, n: int = 100_000) -> float:
    """Max |fp32 kernel - fp64 AdamW| of the parameters after ``steps`` steps (lr 1e-3, wd 0.01)."""
    p64 = torch.randn(n, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    p32, (m64, v64), (m32, v32) = p64.float(), torch.zeros(2, n, dtype=torch.float64), torch.zeros(2, n)
    kw = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}
    for t, g in enumerate(_grads(n, steps), start=1):
        ops.adam(p32, g, m32, v32, step=t, association=association, **kw)
        adam_update([p64], [g.double()], [m64], [v64], step=t, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay=0.01, bias_correction=True, adam_w_mode=True, inv_scale=None)
    return (p32.double() - p64).abs().max().item()


@pytest.mark.timeout(60)
def test_deepspeed_association_error_is_within_deepspeeds_own() -> None:
    # DeepSpeed's own DeepSpeedCPUAdam, run on these parameters and gradients (DeepSpeed 0.19.8,
    # 2026-11-27), ends 1.63e-6 from fp64 (torch's fused AdamW 1.92e-6); its association here must
    # do no worse (5% slack for other CPUs).
    assert _adam_fp64_error("deepspeed") <= 1.63e-6 * 1.05
    with pytest.raises(ValueError, match="association must be one of torch, deepspeed, not 'numpy'"):
        ops.adam(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), step=1, lr=1e-3, beta1=0.9,
                 beta2=0.999, eps=1e-8, weight_decay=0.0, association="numpy")


@pytest.mark.timeout(30)
def test_tensors_the_kernel_does_not_take_go_to_the_reference() -> None:
    # A non-contiguous parameter (a transposed view) and a float64 one: the reference's result.
    base = torch.randn(6, 5, dtype=torch.float32)
    rows = [(base.t(), torch.randn(6, 5).t()), (torch.randn(9, dtype=torch.float64), torch.randn(9, dtype=torch.float64))]
    for p, g in rows:
        kw = {"step": 1, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "bias_correction": True, "adam_w_mode": True, "inv_scale": None}
        for op, reference in ADAM_OPS:
            got, want = p.clone(), p.clone()  # clone keeps the strides
            states = [torch.zeros_like(p) for _ in range(4)]
            op([got], [g], states[:1], states[1:2], **kw)
            reference([want], [g], states[2:3], states[3:], **kw)
            assert torch.equal(got, want), op


def _mixed_rows() -> list[list[torch.Tensor]]:
    """(param, grad, exp_avg, exp_avg_sq) rows, every other one a kind the C kernels do not take."""
    gen = torch.Generator().manual_seed(4)

    def t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    good = [[t(5), t(5), t(5).abs(), t(5).abs()] for _ in range(4)]
    bad = [[t(6, 5).t(), t(5, 6), t(5, 6).abs(), t(5, 6).abs()],  # non-contiguous parameter
           [t(7), t(14)[::2], t(7).abs(), t(7).abs()],  # strided gradient
           [t(3), t(3), t(3).abs(), t(6).abs()[::2]],  # strided state
           [t(4, dtype=torch.float64), t(4, dtype=torch.float64), t(4).abs().double(), t(4).abs().double()]]
    return [row for pair in zip(good, bad, strict=True) for row in pair]


@pytest.mark.timeout(30)
def test_one_list_mixing_taken_and_other_tensors() -> None:
    # The op runs what the kernel takes in C and the rest through the reference, in one call.
    kw = {"step": 2, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
          "bias_correction": True, "adam_w_mode": True, "inv_scale": 0.5}
    got, want = _mixed_rows(), _mixed_rows()
    ops.adam_op(*map(list, zip(*got, strict=True)), **kw)
    adam_update(*map(list, zip(*want, strict=True)), **kw)
    for g, w in zip(got, want, strict=True):
        assert all(torch.allclose(a, b, rtol=0, atol=TOL) for a, b in zip(g, w, strict=True))
    # adam_many runs nothing when a row is not taken: no half-updated list.
    rows, before = _mixed_rows(), _mixed_rows()
    with pytest.raises(ValueError, match=r"got parameter torch.float32 on cpu \(contiguous=False\)"):
        ops.adam_many(*zip(*rows, strict=True), step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                      weight_decay=0.0)
    for row, was in zip(rows, before, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(row, was, strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", SIZES)
def test_16bit_gradients_and_copies(dtype, n) -> None:
    a, b = _pair(n)
    grad16 = (torch.randn(n, generator=torch.Generator().manual_seed(2)) * 64).to(dtype)
    grad16[: min(n, 3)] = torch.tensor([1e-8, -0.0, 3.0])[: min(n, 3)].to(dtype)  # tiny, signed zero
    out = torch.empty(n, dtype=dtype)
    m, v = torch.zeros(n), torch.zeros(n)
    ops.adam(a.data, grad16, m, v, step=1, lr=1e-1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
             grad_mul=1 / 64, out=out)
    m2, v2 = torch.zeros(n), torch.zeros(n)
    adam_update([b.data], [grad16.float()], [m2], [v2], step=1, lr=1e-1, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, bias_correction=True, adam_w_mode=True, inv_scale=1 / 64)
    assert torch.allclose(a, b, rtol=0, atol=TOL)
    assert torch.equal(out, a.detach().to(dtype))  # round to nearest even, as torch


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_copy_rounds_as_torch_including_specials(dtype) -> None:
    p = torch.cat([torch.randn(1000) * 1e3, torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 65520.0,
                                                          1e-40, 3.0e38, 1.00390625, 1.01171875])])
    out = torch.empty(p.numel(), dtype=dtype)
    ops.copy_out(p, out)
    assert torch.equal(out, p.to(dtype))
    nan = torch.full((3,), float("nan"))
    ops.copy_out(nan, out[:3])
    assert out[:3].isnan().all()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_and_overflow(dtype, threads) -> None:
    g = torch.randn((1 << 16) + 5, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = (g.double() / 8).square().sum().item()
    assert ops.grad_sumsq(g, 1 / 8) == pytest.approx(want, rel=1e-12)
    assert ops.grad_sumsq(g[:0]) == 0.0
    for bad in (float("inf"), float("nan")):
        g2 = g.clone()
        g2[-2] = bad
        assert not torch.isfinite(torch.tensor(ops.grad_sumsq(g2)))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls, step", [(torch.optim.AdamW, adam_step), (torch.optim.Adagrad, adagrad_step)],
                         ids=["adamw", "adagrad"])
def test_amp_protocol_grad_scale_and_found_inf(cls, step) -> None:
    # grad_scale divides inside the loop: the kernels' dividing instances, one and several blocks.
    ours, theirs = _pair(70001)
    ours_opt = cls([ours], lr=1e-2, weight_decay=0.1)
    torch_opt = cls([theirs], lr=1e-2, weight_decay=0.1, fused=True)
    for opt in (ours_opt, torch_opt):
        opt.grad_scale = torch.tensor(3.0)
    for g in _grads(70001, 3):
        ours.grad, theirs.grad = g * 3, g * 3
        step(ours_opt)
        torch_opt.step()
    assert torch.allclose(ours, theirs, rtol=0, atol=TOL)
    before = {k: v.clone() for k, v in ours_opt.state[ours].items()}, ours.detach().clone()
    ours_opt.found_inf = torch.tensor(1.0)
    step(ours_opt)  # skipped: nothing moves, not even the step count
    assert torch.equal(ours, before[1])
    assert all(torch.equal(ours_opt.state[ours][k], v) for k, v in before[0].items())


@pytest.mark.timeout(30)
def test_options_the_kernel_lacks_run_torch() -> None:
    ours, theirs = _pair(101)
    ours_opt = torch.optim.Adam([ours], lr=1e-2, amsgrad=True, maximize=True)
    torch_opt = torch.optim.Adam([theirs], lr=1e-2, amsgrad=True, maximize=True)
    for g in _grads(101, 3):
        ours.grad, theirs.grad = g.clone(), g.clone()
        adam_step(ours_opt)
        torch_opt.step()
    assert torch.equal(ours, theirs) and "max_exp_avg_sq" in ours_opt.state[ours]


@pytest.mark.timeout(30)
def test_fp16_conversions_are_exact_for_every_half_and_every_tie() -> None:
    # optim.c converts with integer/float bit operations (so that the loops vectorise).
    halves = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)
    as_float = halves.float()
    ties = ((as_float[:-1].double() + as_float[1:].double()) / 2).float()
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=torch.Generator().manual_seed(4), dtype=torch.int64)
    values = torch.cat([as_float, ties, bits.to(torch.int32).view(torch.float32)])
    out = torch.empty(values.numel(), dtype=torch.float16)
    ops.copy_out(values, out)
    want = values.to(torch.float16)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()].view(torch.int16), want[~want.isnan()].view(torch.int16))
    # half -> float: with beta1 = 0 the first moment becomes the gradient itself (finite ones).
    finite = halves[torch.isfinite(halves)].contiguous()
    n = finite.numel()
    m = torch.zeros(n)
    ops.adam(torch.zeros(n), finite, m, torch.zeros(n), step=1, lr=0.0, beta1=0.0, beta2=0.0, eps=1.0,
             weight_decay=0.0)
    assert torch.equal(m.view(torch.int32), finite.float().view(torch.int32))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n_states", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stream_moves_exactly_the_update_tensors(n_states, dtype, threads) -> None:
    # The bandwidth reference of the bench: reads g, p and the states, writes p, the states and the
    # copy, all of them, and nothing else.
    n = (1 << 16) + 9
    p, *states = _grads(n, 1 + n_states)
    g = torch.randn(n).to(dtype)
    want = [t + g.float() for t in [p, *states]]
    out = torch.empty(n, dtype=torch.bfloat16) if dtype != torch.float32 else None
    ops.stream(p, g, states, out=out)
    assert all(torch.equal(a, b) for a, b in zip([p, *states], want, strict=True))
    assert out is None or torch.equal(out, p.to(torch.bfloat16))
    assert ops.stream_read(g) == pytest.approx(float(g.double().sum()), rel=1e-9, abs=1e-6)


# Rows that cross the 16384-element blocks and, with two threads, the threads' shares: empty rows
# first, between and last, rows shorter than a vector, one spanning many blocks.
ROWS = [0, 3, 16384, 0, 16385, 1, 70001, 9, 0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernel", ["adam", "adagrad", "lion"])
def test_a_list_of_tensors_is_one_call_equal_to_one_call_each(kernel, threads) -> None:
    gen = torch.Generator().manual_seed(3)
    n_states = {"adam": 2, "adagrad": 1, "lion": 1}[kernel]
    grad_dtypes = [torch.float32, torch.bfloat16, torch.float16]  # three tables in one call

    def tensors():
        gen.manual_seed(3)
        params = [torch.randn(n, generator=gen) for n in ROWS]
        grads = [torch.randn(n, generator=gen).to(grad_dtypes[i % 3]) for i, n in enumerate(ROWS)]
        states = [[torch.rand(n, generator=gen) for n in ROWS] for _ in range(n_states)]
        outs = [torch.empty(n, dtype=torch.bfloat16) if i % 2 else None for i, n in enumerate(ROWS)]
        return params, grads, states, outs

    kwargs = {"adam": {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1},
              "adagrad": {"clr": 1e-1, "eps": 1e-10, "weight_decay": 0.1},
              "lion": {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.1}}[kernel]
    many, one = getattr(ops, f"{kernel}_many"), getattr(ops, kernel)
    params, grads, states, outs = tensors()
    many(params, grads, *states, outs=outs, grad_mul=0.5, **kwargs)
    want_params, grads, want_states, want_outs = tensors()
    for i in range(len(ROWS)):
        one(want_params[i], grads[i], *(s[i] for s in want_states), out=want_outs[i], grad_mul=0.5, **kwargs)
    for got, want in zip([params, *states, outs], [want_params, *want_states, want_outs], strict=True):
        for g, w in zip(got, want, strict=True):
            assert (g is None and w is None) or torch.equal(g, w)
    assert not torch.equal(params[6], tensors()[0][6])  # and the update did happen


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fold_sumsq_writes_and_sums_the_same_bits_fused_or_not_at_any_thread_count(dtype) -> None:
    # more than one block and above the parallel threshold: the partials' order is what is checked
    n = (1 << 17) + 7
    src, base = (torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in (4, 5))
    src = src.to(dtype)
    before = torch.get_num_threads()
    for mode, want in (("copy", src.float()), ("add", base + src.float())):
        sums = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            try:
                dst = base.clone()
                sums.append(ops.fold_sumsq(dst, src, mode))
                assert torch.equal(dst, want), mode
                sums.append(ops.fold_sumsq(dst))  # the pass over the written tensor
            finally:
                torch.set_num_threads(before)
        assert len(set(sums)) == 1, (mode, sums)
        assert sums[0] == pytest.approx(want.double().square().sum().item(), rel=1e-12)
    with pytest.raises(ValueError, match="contiguous fp32"):
        ops.fold_sumsq(src.to(torch.bfloat16))
