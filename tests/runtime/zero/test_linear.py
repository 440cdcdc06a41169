"""``deepspeed.runtime.zero.linear``: DeepSpeed's linear Function and module give ``nn.Linear``'s
values and gradients, follow autocast as DeepSpeed's do, and train under ZeRO-3 (its weights
released between forward and backward) as ``nn.Linear`` does in one process."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.distributed import run_world

WIDTH, OUT, STEPS = 6, 5, 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("shape", [(WIDTH,), (4, WIDTH), (2, 3, WIDTH)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("bias", [True, False])
def test_the_function_gives_linear_values_and_gradients(shape: tuple[int, ...], bias: bool) -> None:
    from dslaunch.runtime.zero.linear import LinearModuleForZeroStage3

    torch.manual_seed(0)
    ours = LinearModuleForZeroStage3(WIDTH, OUT, bias=bias).double()
    ref = torch.nn.Linear(WIDTH, OUT, bias=bias).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(*shape, dtype=torch.float64)
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ours, out_ref = ours(x_ours), ref(x_ref)
    torch.testing.assert_close(out_ours, out_ref)
    grad = torch.randn_like(out_ref)
    out_ours.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert repr(ours).endswith(f"(in_features={WIDTH}, out_features={OUT}, bias={bias})")


@pytest.mark.timeout(30)
def test_gradcheck_of_the_function() -> None:
    from dslaunch.runtime.zero.linear import zero3_linear_wrap

    torch.manual_seed(1)
    args = (torch.randn(3, WIDTH, dtype=torch.float64, requires_grad=True),
            torch.randn(OUT, WIDTH, dtype=torch.float64, requires_grad=True),
            torch.randn(OUT, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(zero3_linear_wrap, args)
    # generate_vmap_rule: torch.func transforms go through the Function (DeepSpeed tests vmap)
    xs = torch.randn(5, WIDTH, dtype=torch.float64)
    per_row = torch.func.vmap(lambda x: zero3_linear_wrap(x, args[1], args[2]).sum())(xs)
    torch.testing.assert_close(per_row, (xs @ args[1].t() + args[2]).sum(-1))


@pytest.mark.timeout(30)
def test_autocast_as_deepspeed() -> None:
    from dslaunch.runtime.zero import linear

    torch.manual_seed(2)
    layer = linear.LinearModuleForZeroStage3(WIDTH, OUT)
    x = torch.randn(4, WIDTH, requires_grad=True)
    assert layer(x).dtype == torch.float32  # no autocast: the weight's dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
        with torch.autocast("cpu", enabled=False):
            assert layer(x).dtype == torch.float32
    assert out.dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a 1-D input: matmul then the bias, still bf16
        assert layer(x[0]).dtype == torch.bfloat16
    assert out.grad_fn._fwd_used_autocast is True and out.grad_fn._dtype == torch.bfloat16
    out.float().sum().backward()  # backward under the forward's autocast: grads in the leaves' dtype
    assert layer.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    assert isinstance(linear.autocast_custom_fwd, functools.partial)
    assert linear.autocast_custom_fwd.func is torch.amp.custom_fwd
    assert linear.autocast_custom_bwd.keywords == {"device_type": "cpu"}


class _Net(torch.nn.Module):
    def __init__(self, ours: bool):
        super().__init__()
        from dslaunch.runtime.zero.linear import LinearModuleForZeroStage3

        torch.manual_seed(3)
        make = LinearModuleForZeroStage3 if ours else torch.nn.Linear
        self.a, self.b = make(WIDTH, 16), make(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).pow(2).mean()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))


def _train_stage3(rank: int, world: int) -> dict[str, torch.Tensor]:
    import dslaunch
    from dslaunch.runtime.zero import params as zp
    from dslaunch.runtime.zero.linear import LinearFunctionForZeroStage3
    from dslaunch.utils import safe_get_full_fp32_param

    model = _Net(ours=True)
    engine, *_ = dslaunch.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10_000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.2}}})
    for step in range(STEPS):
        loss = engine(_batch(step, rank))
        # released between forward and backward: the backward must gather the weights again
        assert all(p.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        engine.backward(loss)
        engine.step()
    full = {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}
    # Outside the engine's hooks: the Function saved a weight that is released before backward
    x = _batch(STEPS, rank).requires_grad_()
    with dslaunch.zero.GatheredParameters(list(model.a.parameters())):
        out = LinearFunctionForZeroStage3.apply(x, model.a.weight, model.a.bias)
    assert model.a.weight.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE
    out.sum().backward()
    assert model.a.weight.ds_status is zp.ZeroParamStatus.NOT_AVAILABLE  # released again
    want = torch.ones(4, 16).matmul(full["a.weight"])
    assert torch.equal(x.grad, want)
    return full


@pytest.mark.timeout(90)
def test_it_trains_under_zero3_as_linear_does() -> None:
    got = run_world(_train_stage3, 2)
    ref = _Net(ours=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(STEPS):
        (sum(ref(_batch(step, rank)) for rank in range(2)) / 2).backward()
        opt.step()
        opt.zero_grad()
    for rank_state in got:
        for name, p in ref.named_parameters():
            torch.testing.assert_close(rank_state[name], p.detach(), rtol=1e-5, atol=1e-6, msg=name)
