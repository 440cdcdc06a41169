"""``dslaunch.ops``: DeepSpeed's CPU optimizer classes by DeepSpeed's import paths, with its
arguments, state layout and step semantics, against torch (or the reference) within 1e-6."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dslaunch import kernels
from dslaunch.kernels.cpu import build
from dslaunch.kernels.reference import adagrad_update
from dslaunch.ops.adagrad import DeepSpeedCPUAdagrad
from dslaunch.ops.adam import DeepSpeedCPUAdam, FusedAdam
from dslaunch.ops.lion import DeepSpeedCPULion
from dslaunch.runtime.optim.adam import Adam as ReferenceAdam
from dslaunch.runtime.optim.lion import Lion as ReferenceLion

TOL = 1e-6
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _run(ours, theirs, params, steps: int = 4) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in params[0]]
        for side in params:
            for p, grad in zip(side, grads, strict=True):
                p.grad = grad.clone().to(p.dtype)
        ours.step()
        theirs.step()


def _params(*sizes: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(n, generator=g) for n in sizes]
    return [[torch.nn.Parameter(b.clone().to(dtype)) for b in base] for _ in range(2)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_cpu_adam(adamw_mode: bool, bias_correction: bool) -> None:
    ours_p, ref_p = _params(0, 1, 1031)
    kw = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05, "bias_correction": bias_correction}
    ours = DeepSpeedCPUAdam(ours_p, adamw_mode=adamw_mode, **kw)
    ref = ReferenceAdam(ref_p, adam_w_mode=adamw_mode, **kw)
    _run(ours, ref, [ours_p, ref_p])
    for a, b in zip(ours_p, ref_p, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TOL)
    state = ours.state[ours_p[2]]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"] and state["step"] == 4  # an int, as DeepSpeed


@pytest.mark.timeout(30)
def test_cpu_adam_matches_torch_adamw_and_refuses_amsgrad() -> None:
    ours_p, ref_p = _params(4097)
    ours = DeepSpeedCPUAdam(ours_p, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_p, lr=1e-2, weight_decay=0.1, fused=True)
    _run(ours, ref, [ours_p, ref_p])
    assert torch.allclose(ours_p[0], ref_p[0], rtol=0, atol=TOL)
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        DeepSpeedCPUAdam(ours_p, amsgrad=True)


@pytest.mark.timeout(30)
def test_cpu_adam_rounds_as_deepspeed_and_fused_adam_as_torch() -> None:
    # DeepSpeed's class takes DeepSpeed's association (the "cpu_adam" op, one division per
    # element), FusedAdam torch's (the "adam" op); the two differ in the last bits.
    base = torch.randn(4097, generator=torch.Generator().manual_seed(0))
    ds_p, fused_p, torch_p = ([torch.nn.Parameter(base.clone())] for _ in range(3))
    g = torch.Generator().manual_seed(3)
    kw = {"lr": 1e-2, "weight_decay": 0.1}
    opts = [DeepSpeedCPUAdam(ds_p, **kw), FusedAdam(fused_p, **kw),
            torch.optim.AdamW(torch_p, fused=True, **kw)]
    ds_want, m, v = ds_p[0].detach().clone(), torch.zeros(4097), torch.zeros(4097)
    for t in range(1, 4):
        grad = torch.randn(4097, generator=g)
        for side in (ds_p, fused_p, torch_p):
            side[0].grad = grad.clone()
        for opt in opts:
            opt.step()
        kernels.get("cpu_adam", "cpu")([ds_want], [grad], [m], [v], step=t, lr=1e-2, betas=(0.9, 0.999),
                                       eps=1e-8, weight_decay=0.1, bias_correction=True, adam_w_mode=True,
                                       inv_scale=None)
    assert torch.equal(ds_p[0], ds_want) and torch.equal(fused_p[0], torch_p[0])
    assert not torch.equal(ds_p[0], torch_p[0])
    assert torch.allclose(ds_p[0], torch_p[0], rtol=0, atol=TOL)


@pytest.mark.timeout(30)
@pytest.mark.skipif(not build.available() or not _THP.exists() or "[never]" in _THP.read_text(),
                    reason="no C kernels or no transparent huge pages")
def test_large_states_are_advised_onto_huge_pages() -> None:
    # 8 MiB states: madvise(MADV_HUGEPAGE) before they are zeroed makes them THP-eligible.
    p = torch.nn.Parameter(torch.zeros(2 << 20))
    p.grad = torch.ones(2 << 20)
    opt = DeepSpeedCPUAdam([p])
    opt.step()
    assert _thp_eligible(opt.state[p]["exp_avg"]) and _thp_eligible(opt.state[p]["exp_avg_sq"])


def _thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding ``t``'s middle may use huge pages (``THPeligible`` in smaps)."""
    addr, mapping = t.data_ptr() + t.numel() * t.element_size() // 2, None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= addr < hi
        elif mapping and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    return False


@pytest.mark.timeout(30)
def test_bf16_params_are_updated_through_fp32() -> None:
    ours_p, ref_p = _params(1000, dtype=torch.bfloat16)
    ours = DeepSpeedCPUAdam(ours_p, lr=1e-2, fp32_optimizer_states=False)
    ref32 = [torch.nn.Parameter(p.detach().float()) for p in ref_p]
    ref = ReferenceAdam(ref32, lr=1e-2)
    g = torch.randn(1000)
    ours_p[0].grad, ref32[0].grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float()
    ours.step()
    ref.step()
    assert ours.state[ours_p[0]]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(ours_p[0].detach(), ref32[0].detach().to(torch.bfloat16))


@pytest.mark.timeout(30)
def test_cpu_adagrad() -> None:
    ours_p, ref_p = _params(1, 777)
    ours = DeepSpeedCPUAdagrad(ours_p, lr=1e-1, weight_decay=0.1)
    ref = torch.optim.Adagrad(ref_p, lr=1e-1, weight_decay=0.1, eps=1e-10)
    _run(ours, ref, [ours_p, ref_p])
    for a, b in zip(ours_p, ref_p, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TOL)
    assert sorted(ours.state[ours_p[1]]) == ["exp_avg_sq", "step"]


@pytest.mark.timeout(30)
def test_cpu_adagrad_updates_only_the_rows_of_a_sparse_gradient() -> None:
    torch.manual_seed(0)
    ours_e, ref_e = (torch.nn.Embedding(50, 6, sparse=True) for _ in range(2))
    ref_e.load_state_dict(ours_e.state_dict())
    ours, ref = DeepSpeedCPUAdagrad(ours_e.parameters(), lr=0.1), torch.optim.Adagrad(ref_e.parameters(), lr=0.1)
    for step in range(4):
        ids = torch.randint(0, 50, (7,), generator=torch.Generator().manual_seed(step))  # repeats sum
        for emb, opt in ((ours_e, ours), (ref_e, ref)):
            opt.zero_grad()
            emb(ids).pow(2).sum().backward()
            assert emb.weight.grad.is_sparse
            opt.step()
        assert torch.allclose(ours_e.weight, ref_e.weight, rtol=0, atol=TOL)
    untouched = ours.state[ours_e.weight]["exp_avg_sq"].sum(1) == 0  # rows no batch looked up
    assert untouched.any() and torch.equal(ours_e.weight[untouched], ref_e.weight[untouched])
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdam does not support sparse gradients"):
        emb = torch.nn.Embedding(5, 2, sparse=True)
        emb(torch.tensor([1])).sum().backward()
        DeepSpeedCPUAdam(emb.parameters()).step()


@pytest.mark.timeout(30)
def test_cpu_lion() -> None:
    ours_p, ref_p = _params(3, 2049)
    ours = DeepSpeedCPULion(ours_p, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    ref = ReferenceLion(ref_p, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    _run(ours, ref, [ours_p, ref_p])
    for a, b in zip(ours_p, ref_p, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=TOL)


@pytest.mark.timeout(30)
def test_fused_adam_arguments() -> None:
    ours_p, ref_p = _params(515)
    ours = FusedAdam(ours_p, lr=1e-2, adam_w_mode=False, weight_decay=0.1)
    ref = torch.optim.Adam(ref_p, lr=1e-2, weight_decay=0.1, fused=True)
    _run(ours, ref, [ours_p, ref_p])
    assert torch.allclose(ours_p[0], ref_p[0], rtol=0, atol=TOL)
    ours.zero_grad()
    assert ours_p[0].grad is None  # set_grad_none
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(ours_p, amsgrad=True)
    with pytest.raises(RuntimeError, match="takes no grads"):
        ours.step(grads=[1])


@pytest.mark.timeout(30)
def test_non_cpu_params_are_refused_with_the_fix() -> None:
    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    p.grad = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match="must be on the CPU.*offload_optimizer"):
        DeepSpeedCPUAdam([p]).step()


def test_the_reference_adagrad_is_torch_adagrad() -> None:
    a = torch.randn(50)
    b = torch.nn.Parameter(a.clone())
    s = torch.zeros(50)
    opt = torch.optim.Adagrad([b], lr=0.1, eps=1e-10, foreach=False)
    for _ in range(3):
        g = torch.randn(50)
        adagrad_update([a], [g], [s], clr=0.1, eps=1e-10, weight_decay=0.0, inv_scale=None)
        b.grad = g
        opt.step()
    assert torch.allclose(a, b, rtol=0, atol=TOL)


def test_a_scripts_own_op_builder_imports_and_its_load_is_one_line() -> None:
    """Megatron-DeepSpeed subclasses ``op_builder.builder.OpBuilder`` for its fused kernels and
    checks ``TORCH_MAJOR``/``TORCH_MINOR``: importing works, building says dslaunch builds none."""
    from dslaunch.ops.op_builder.builder import TORCH_MAJOR, TORCH_MINOR, OpBuilder

    class FusedKernels(OpBuilder):
        NAME = "megatron_fused_kernels"

    assert (TORCH_MAJOR, TORCH_MINOR) == tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert not FusedKernels().is_compatible()
    with pytest.raises(RuntimeError, match=r"^FusedKernels.load\(\): dslaunch has no JIT-built DeepSpeed ops"):
        FusedKernels().load()


def test_offload_states_names_and_signatures_are_deepspeeds() -> None:
    """DeepSpeedExamples' offload_states script imports the enums and calls the engine's methods
    with DeepSpeed 0.19.8's keywords (the behaviour: tests/runtime/zero/test_offload_states.py)."""
    import inspect

    from dslaunch.runtime.engine import DeepSpeedEngine
    from dslaunch.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    assert [e.value for e in OffloadStateTypeEnum] == ["optim_states", "hp_params", "lp_params", "lp_grads",
                                                      "contiguous_grad_buffer"]
    offload = inspect.signature(DeepSpeedEngine.offload_states).parameters
    assert {k: v.default for k, v in offload.items() if k != "self"} == {
        "include": None, "device": OffloadDeviceEnum.cpu, "pin_memory": True, "non_blocking": False}
    assert inspect.signature(DeepSpeedEngine.reload_states).parameters["non_blocking"].default is False
