"""The Triton multi-tensor Adam (interpreted, CPU tensors): the ``"adam"`` op against the reference
over several steps (both modes, bias correction on/off, a gradient scale, inf/NaN gradients, sizes
0, 1, odd and not a multiple of the block, bf16/fp16 parameters), and ``FusedAdam`` routed through
it against torch's AdamW/Adam within 1e-6."""

from __future__ import annotations

import pytest
import torch

from dslaunch.kernels import dispatch
from dslaunch.kernels.dispatch import Kernel, KernelTable
from dslaunch.kernels.reference import adam_update
from dslaunch.ops.adam import FusedAdam
from tests.kernels.triton.interpret import kernel_module

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SIZES = (0, 1, 7, 1025, 2 * 1024 + 3)  # the kernel's BLOCK is 1024
TOL = 1e-6


def _state(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=g).to(dtype) for n in SIZES]
    return [params, [torch.zeros_like(p, dtype=torch.float32) for p in params],
            [torch.zeros_like(p, dtype=torch.float32) for p in params]]


@pytest.mark.parametrize("adam_w_mode, bias_correction, inv_scale",
                         [(True, True, None), (False, True, 0.25), (True, False, 1 / 1024)])
def test_adam_op_matches_the_reference(adam_w_mode: bool, bias_correction: bool, inv_scale: float | None) -> None:
    adam = kernel_module("adam")
    ours, ref = _state(), _state()
    g = torch.Generator().manual_seed(1)
    for step in range(1, 5):
        grads = [torch.randn(n, generator=g) * 8 for n in SIZES]
        kw = {"step": step, "lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05,
              "bias_correction": bias_correction, "adam_w_mode": adam_w_mode, "inv_scale": inv_scale}
        adam.adam_op(ours[0], grads, ours[1], ours[2], **kw)
        adam_update(ref[0], grads, ref[1], ref[2], **kw)
    for a, b in zip(sum(ours, []), sum(ref, []), strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TOL), (a - b).abs().max()
    assert any(not torch.equal(a, b) for a, b in zip(ours[0], _state()[0], strict=True))  # it moved


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN math in numpy
def test_inf_and_nan_gradients_propagate_as_in_the_reference() -> None:
    adam = kernel_module("adam")
    ours, ref = _state(), _state()
    grads = [torch.randn(n) for n in SIZES]
    grads[3][[0, 500, 1024]] = torch.tensor([float("inf"), float("nan"), -float("inf")])
    kw = {"step": 1, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
          "bias_correction": True, "adam_w_mode": True, "inv_scale": 1 / 65536}
    adam.adam_op(ours[0], grads, ours[1], ours[2], **kw)
    adam_update(ref[0], grads, ref[1], ref[2], **kw)
    for a, b in zip(sum(ours, []), sum(ref, []), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=TOL, equal_nan=True)
    assert ours[0][3].isnan().sum() == 3 and ours[0][3].isfinite().sum() == 1022


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_params_are_computed_in_fp32(dtype: torch.dtype) -> None:
    """Each step against the reference on the same 16-bit params widened to fp32, rounded back.

    Triton's interpreter truncates fp32 to bf16 (3.9.0's ``cast_impl``; a GPU rounds to nearest
    even), so bf16 params may be one ulp lower in magnitude; fp16 is rounded as on a GPU.
    """
    adam = kernel_module("adam")
    ours, master = _state(dtype), _state()
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads32 = [torch.randn(n, generator=g) for n in SIZES]
        kw = {"step": step, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
              "bias_correction": True, "adam_w_mode": True, "inv_scale": None}
        widened = [p.float() for p in ours[0]]
        adam.adam_op(ours[0], [x.to(dtype) for x in grads32], ours[1], ours[2], **kw)
        adam_update(widened, [x.to(dtype).float() for x in grads32], master[1], master[2], **kw)
        for a, w in zip(ours[0], widened, strict=True):
            want = w.to(dtype)
            ulp = torch.finfo(dtype).eps * w.abs().clamp_min(torch.finfo(dtype).tiny)
            off = (a.float() - want.float()).abs()
            assert a.dtype == dtype and bool((off <= (ulp if dtype == torch.bfloat16 else 0)).all()), off.max()
        for a, b in zip(ours[1] + ours[2], master[1] + master[2], strict=True):
            assert torch.allclose(a, b, rtol=0, atol=TOL)


def test_mixed_dtypes_and_non_contiguous_entries() -> None:
    """One launch per dtype combination; a non-contiguous gradient's entry runs the reference."""
    adam = kernel_module("adam")
    kw = {"step": 2, "lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1,
          "bias_correction": True, "adam_w_mode": False, "inv_scale": None}
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(5, generator=g), torch.randn(1030, generator=g).half(), torch.randn(7, generator=g)]
    grads = [torch.randn(5, generator=g), torch.randn(1030, generator=g).half(), torch.randn(7, 2, generator=g)[:, 0]]
    moments = [[torch.rand(p.shape, generator=g) for p in params] for _ in range(2)]
    ours = [[t.clone() for t in x] for x in (params, moments[0], moments[1])]
    adam.adam_op(ours[0], grads, ours[1], ours[2], **kw)
    for i in range(3):  # the reference on each entry alone, in fp32
        p32 = [params[i].float()]
        ms = [[moments[0][i].clone()], [moments[1][i].clone()]]
        adam_update(p32, [grads[i].float()], ms[0], ms[1], **kw)
        assert ours[0][i].dtype == params[i].dtype
        assert torch.allclose(ours[0][i].float(), p32[0].to(params[i].dtype).float(), rtol=0, atol=1e-3 if i == 1 else TOL)
        assert torch.allclose(ours[1][i], ms[0][0], rtol=0, atol=TOL) and torch.allclose(ours[2][i], ms[1][0], rtol=0, atol=TOL)
    with pytest.raises(ValueError, match="must pair up tensors of one size"):
        adam.adam_op([torch.zeros(4)], [torch.zeros(5)], [torch.zeros(4)], [torch.zeros(4)], **kw)


def _params() -> list[list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in SIZES] + [torch.randn(6, 5, generator=g).t()]  # non-contiguous
    return [[torch.nn.Parameter(b.clone()) for b in base] for _ in range(2)]


@pytest.mark.parametrize("torch_class, adam_w_mode", [(torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_fused_adam_through_the_kernel_matches_torch(torch_class: type, adam_w_mode: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    adam = kernel_module("adam")
    calls: list[int] = []

    def spy(params, *args, **kwargs):
        calls.append(len(params))
        return adam.adam_op(params, *args, **kwargs)

    spy.handles_dtypes = True
    # The dispatch point picks Triton only on CUDA: register it for CPU tensors here.
    monkeypatch.setattr(dispatch, "KERNELS", KernelTable(dispatch.KERNELS.reference, {"adam": (Kernel(spy, ("cpu",)),)}))
    monkeypatch.setenv("DSLAUNCH_KERNELS", "fused")
    ours_p, ref_p = _params()
    ours = FusedAdam(ours_p, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, adam_w_mode=adam_w_mode)
    ref = torch_class(ref_p, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        for a, b in zip(ours_p, ref_p, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        ours.step()
        ref.step()
    assert calls == [len(SIZES) + 1] * 4  # one call per step for every parameter
    for a, b in zip(ours_p, ref_p, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TOL), (a - b).abs().max()
    assert ours.state[ours_p[-1]]["step"] == 4
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        FusedAdam(ours_p, amsgrad=True)


def test_fused_adam_hands_bf16_params_to_the_kernel_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    adam = kernel_module("adam")
    seen: list[torch.dtype] = []

    def spy(params, *args, **kwargs):
        seen.extend(p.dtype for p in params)
        return adam.adam_op(params, *args, **kwargs)

    spy.handles_dtypes = True
    triton_table = KernelTable(dispatch.KERNELS.reference, {"adam": (Kernel(spy, ("cpu",)),)})
    sides = []
    for table, mode in ((triton_table, "fused"), (dispatch.KERNELS, "reference")):
        monkeypatch.setattr(dispatch, "KERNELS", table)
        monkeypatch.setenv("DSLAUNCH_KERNELS", mode)
        params = [torch.nn.Parameter(p.detach().to(torch.bfloat16)) for p in _params()[0]]
        for p in params:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(torch.bfloat16)
        FusedAdam(params, lr=1e-2, weight_decay=0.1).step()
        sides.append(params)
    assert seen and set(seen) == {torch.bfloat16}  # no fp32 copies for the kernel
    for a, b in zip(*sides, strict=True):  # the reference path: fp32 copies, rounded back
        ulp = torch.finfo(torch.bfloat16).eps * b.detach().float().abs()
        assert a.dtype == torch.bfloat16 and bool(((a - b).float().abs() <= ulp).all())  # interpreter truncates
