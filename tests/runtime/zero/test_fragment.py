"""DeepSpeed's tensor-fragment API (``deepspeed.utils.safe_get/set_full_*``, ``safe_*_local_*``,
``safe_update_full_grad_vectorized``) on 2 gloo ranks: round trips, and a set gradient, master or
optimizer state changing the next step exactly as plain torch Adam predicts."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_world

LR = 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # odd sizes: at stages 1-3 ranks split parameters unevenly
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _values(model: torch.nn.Module, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)  # the same on every rank; exact in ``dtype``
    return {n: torch.rand(tuple(getattr(p, "ds_shape", p.shape)), generator=g).to(dtype).float()
            for n, p in model.named_parameters()}


def _run(rank: int, world: int, stage: int, offload: str, precision: str, nvme_path: str) -> None:
    import dslaunch
    from dslaunch.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_grad,
        safe_update_full_grad_vectorized,
    )

    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "zero_optimization": {"stage": stage}}
    if offload != "none":
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload, "nvme_path": nvme_path}
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **({"initial_scale_power": 8} if precision == "fp16" else {})}
    model = _model()
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    ref = {n: torch.nn.Parameter(v) for n, v in _values(model, 1).items()}  # the plain-torch twin
    opt = torch.optim.Adam(ref.values(), lr=LR)
    params = dict(model.named_parameters())
    x = torch.rand(2, 5, dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision])

    for step, seed in enumerate((2, 3)):
        engine.backward(engine(x).float().pow(2).mean())
        grads = _values(model, seed, torch.bfloat16)
        if step == 0:
            for n, p in params.items():
                safe_set_full_fp32_param(p, ref[n].detach())
                safe_set_full_grad(p, grads[n] * 3)
                assert torch.equal(safe_get_full_fp32_param(p), ref[n].detach()), n
            # the vectorized update sees the value set above and replaces it
            safe_update_full_grad_vectorized(list(params.values()), lambda g, p: g / 3)
        else:
            states = _values(model, 4)
            for n, p in params.items():
                safe_set_full_optimizer_state(p, states[n], "exp_avg")
                opt.state[ref[n]]["exp_avg"] = states[n].clone()
                assert torch.equal(safe_get_full_optimizer_state(p, "exp_avg"), states[n]), n
                safe_set_full_grad(p, grads[n])
        for n, p in params.items():
            assert torch.equal(safe_get_full_grad(p), grads[n]), n
            ref[n].grad = grads[n] / engine.loss_scaler.loss_scale  # fp16: grads are read and set scaled
        if stage == 3:  # this rank's pieces, in rank order, are the whole parameter
            for n, p in params.items():
                assert safe_get_local_grad(p).shape == p.ds_tensor.shape, n
                for get in (safe_get_local_fp32_param, safe_get_local_grad):
                    pieces = [None] * world
                    torch.distributed.all_gather_object(pieces, get(p))
                    whole = (safe_get_full_fp32_param if get is safe_get_local_fp32_param else safe_get_full_grad)(p)
                    assert torch.equal(torch.cat(pieces), whole.reshape(-1)), n
        engine.step()
        opt.step()
        for n, p in params.items():
            torch.testing.assert_close(safe_get_full_fp32_param(p), ref[n].detach(), rtol=1e-6, atol=1e-7, msg=n)
            torch.testing.assert_close(safe_get_full_optimizer_state(p, "exp_avg_sq"),
                                       opt.state[ref[n]]["exp_avg_sq"], rtol=1e-6, atol=1e-9)

    p = params["0.weight"]
    if stage != 3:
        with pytest.raises(ValueError, match="only defined for ZeRO-3"):
            safe_get_local_fp32_param(p)
    else:  # a local grad set reaches the whole gradient
        engine.backward(engine(x).float().pow(2).mean())
        piece = torch.full(p.ds_tensor.shape, float(rank + 1))
        safe_set_local_grad(p, piece)
        assert torch.equal(safe_get_local_grad(p), piece)
        counts = [None] * world
        torch.distributed.all_gather_object(counts, p.ds_tensor.numel())
        want = torch.cat([torch.full((c,), float(r + 1)) for r, c in enumerate(counts)])
        assert torch.equal(safe_get_full_grad(p).reshape(-1), want)
        with pytest.raises(ValueError, match="elements"):
            safe_set_local_grad(p, torch.zeros(p.ds_numel + 1))
    engine.destroy()


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("stage", "offload", "precision"),
                         [(1, "none", "fp32"), (2, "cpu", "fp32"), (2, "none", "bf16"), (3, "none", "fp32"),
                          (3, "cpu", "bf16"), (3, "nvme", "fp32"), (1, "cpu", "fp16")])
def test_fragments_set_get_and_step_as_torch(stage: int, offload: str, precision: str, tmp_path) -> None:
    run_world(_run, 2, stage, offload, precision, str(tmp_path))


def _unreduced(rank: int, world: int, stage: int) -> list[bool]:
    import dslaunch
    from dslaunch.utils import safe_get_full_grad

    model = _model()
    engine, *_ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}})
    twin = _model()  # plain torch, this rank's data only
    xs = [torch.rand(2, 5, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(2)]
    out = []
    with engine.no_sync():
        engine.backward(engine(xs[0]).pow(2).mean())
    (twin(xs[0]).pow(2).mean() / 2).backward()  # the engine divides by the accumulation steps
    # unreduced: this rank's own gradient so far (DeepSpeed's param.grad), not an error
    pairs = list(zip(model.parameters(), twin.parameters(), strict=True))
    out += [torch.allclose(safe_get_full_grad(p), q.grad) for p, q in pairs]
    engine.step()  # not a boundary: counts the micro step
    engine.backward(engine(xs[1]).pow(2).mean())  # the boundary: reduced, the average over ranks
    (twin(xs[1]).pow(2).mean() / 2).backward()
    for p, q in pairs:
        mean = q.grad.clone()
        torch.distributed.all_reduce(mean)
        out.append(torch.allclose(safe_get_full_grad(p), mean / world))
    engine.destroy()
    return out


@pytest.mark.timeout(120)
def test_full_grad_before_the_reduction_is_the_ranks_own() -> None:
    for stage in (0, 1):
        got = run_world(_unreduced, 2, stage)
        assert all(all(ok) for ok in got), f"stage {stage}: {got}"
