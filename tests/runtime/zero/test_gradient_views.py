"""The gradient data DeepSpeed's wrappers expose (``runtime/zero/gradient_views.py`` through
``optimizer_view.py``), on real gloo ranks, checked against gradients computed by plain torch:
``averaged_gradients`` (stages 1-3), stage 3's ``_get_norm_groups()``, ``BF16_Optimizer``'s
``fp32_groups_gradients_flat`` and stages 1/2's ``parallel_partitioned_bit16_groups``."""

from __future__ import annotations

import pytest
import torch

import dslaunch
from tests.distributed import run_world

WORLD = 2


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(100 * micro + rank))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Two param groups, as a script's weight-decay split makes them: weights, then biases."""
    return [[p for n, p in model.named_parameters() if n.endswith("weight")],
            [p for n, p in model.named_parameters() if n.endswith("bias")]]


def _reference(micros: int) -> list[list[torch.Tensor]]:
    """Each group's averaged gradient, per parameter: the mean over ranks of the micro steps' sum,
    each micro step's loss divided by their count (DeepSpeed's engine.backward), by plain torch."""
    model = _model()
    for rank in range(WORLD):
        for micro in range(micros):
            (_loss(model(_batch(rank, micro))) / micros / WORLD).backward()
    return [[p.grad.clone() for p in group] for group in _groups(model)]


def _engine(stage: int, micros: int = 1):
    model = _model()
    params = [{"params": g, "weight_decay": wd} for g, wd in zip(_groups(model), (0.1, 0.0), strict=True)]
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": micros,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    engine, opt, _, _ = dslaunch.initialize(model=model, model_parameters=params, config=config)
    return engine, opt


def _gather(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _stage3(rank: int, world: int) -> dict:
    engine, opt = _engine(3)
    engine.backward(_loss(engine(_batch(rank, 0))))
    avg = opt.averaged_gradients
    out = {"keys": sorted(avg), "counts": [len(avg[gi]) for gi in sorted(avg)],
           "pieces": _gather({gi: [t.clone() for t in ts] for gi, ts in avg.items()}),
           "norms": [float(n) for n in opt._get_norm_groups()]}
    for p in engine.module.parameters():  # halve every gradient the step will apply
        dslaunch.utils.safe_set_local_grad(p, dslaunch.utils.safe_get_local_grad(p) / 2)
    out["halved"] = [float(n) for n in opt._get_norm_groups()]
    engine.step()
    out["step_norm"] = float(opt._global_grad_norm)  # the norm the step itself took
    engine.backward(_loss(engine(_batch(rank, 1))) * float("inf"))
    out["overflowed"] = [float(n) for n in opt._get_norm_groups()]
    engine.destroy()
    return out


@pytest.mark.timeout(180)
def test_stage3_averaged_gradients_and_norm_groups_are_the_averaged_gradients_of_plain_torch() -> None:
    ref = _reference(1)
    for got in run_world(_stage3, WORLD, timeout=150):
        assert got["keys"] == [0, 1] and got["counts"] == [2, 2]  # DeepSpeed's: every parameter's piece
        for gi, group in enumerate(ref):
            for pi, grad in enumerate(group):
                # the ranks' pieces, in rank order, are the whole averaged gradient
                whole = torch.cat([pieces[gi][pi] for pieces in got["pieces"]])
                torch.testing.assert_close(whole, grad.reshape(-1), atol=1e-6, rtol=1e-5)
        expected = [float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in group]))) for group in ref]
        assert got["norms"] == pytest.approx(expected, rel=1e-5)
        assert got["halved"] == pytest.approx([n / 2 for n in expected], rel=1e-5)  # read anew each call
        assert got["step_norm"] == pytest.approx(sum(n * n for n in got["halved"]) ** 0.5, rel=1e-6)
        assert got["overflowed"] == [-1.0, -1.0]  # DeepSpeed's mark of an inf/NaN norm


def _stage12(rank: int, world: int, stage: int) -> dict:
    engine, opt = _engine(stage, micros=2)
    engine.backward(_loss(engine(_batch(rank, 0))))
    out = {"before_boundary": opt.averaged_gradients if stage == 1 else None}
    engine.step()  # not the boundary: only counts the micro step
    engine.backward(_loss(engine(_batch(rank, 1))))
    avg = opt.averaged_gradients
    out["pieces"] = _gather({gi: torch.cat(ts) for gi, ts in avg.items()})
    flat = [torch.cat([p.detach().reshape(-1) for p in g]) for g in _groups(engine.module)]
    parts = opt.parallel_partitioned_bit16_groups
    out["parts"] = [(torch.cat(ps)[:f.numel()].equal(f), [p.numel() for p in ps],
                     [p.data_ptr() - ps[0].data_ptr() for p in ps], ps[0].data_ptr() == g[0].data_ptr())
                    for ps, f, g in zip(parts, flat, _groups(engine.module), strict=True)]
    out["alignment"] = opt.nccl_start_alignment_factor
    engine.step()
    engine.destroy()
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stage", [1, 2])
def test_stage12_averaged_gradients_are_each_ranks_partition_of_the_averaged_gradient(stage: int) -> None:
    ref = _reference(2)
    for got in run_world(_stage12, WORLD, stage, timeout=150):
        if stage == 1:  # not reduced before the boundary: DeepSpeed has none either
            assert got["before_boundary"] == {}
        for gi, group in enumerate(ref):
            whole = torch.cat([pieces[gi] for pieces in got["pieces"]])
            torch.testing.assert_close(whole, torch.cat([g.reshape(-1) for g in group]), atol=1e-6, rtol=1e-5)
        # weights: 35 + 21 = 56 elements, 28 per rank; biases: 7 + 3 = 10, 5 per rank: the second
        # rank's partition starts 5 fp32 elements in (dslaunch pads to the world size, not for NCCL)
        assert got["parts"] == [(True, [28, 28], [0, 28 * 4], True), (True, [5, 5], [0, 5 * 4], True)]
        assert got["alignment"] == 1


def _bf16(rank: int, world: int) -> dict:
    model = torch.nn.Linear(4, 1, bias=False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
              "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
    engine, opt, _, _ = dslaunch.initialize(model=model, model_parameters=model.parameters(), config=config)
    out = {"class": type(opt).__name__, "alignment": opt.nccl_start_alignment_factor, "flat": []}
    for micro in range(2):
        x = torch.tensor([1.0, 3.0, 5.0, 7.0]) + 10 * micro + 20 * rank  # exact in bf16
        engine.backward(engine(x.to(torch.bfloat16)).sum())
        out["flat"].append([t.clone() for t in opt.fp32_groups_gradients_flat])
        engine.step()
    engine.destroy()
    return out


@pytest.mark.timeout(180)
def test_bf16_optimizer_flat_fp32_gradient_is_the_local_sum_then_the_average() -> None:
    x = [[torch.tensor([1.0, 3.0, 5.0, 7.0]) + 10 * m + 20 * r for m in range(2)] for r in range(WORLD)]
    for rank, got in enumerate(run_world(_bf16, WORLD, timeout=150)):
        assert got["class"] == "BF16_Optimizer" and got["alignment"] == 1
        first, boundary = got["flat"]
        assert first[0].dtype == torch.float32
        torch.testing.assert_close(first[0], x[rank][0] / 2, atol=0, rtol=0)  # this rank's, unreduced
        average = sum(x[r][0] + x[r][1] for r in range(WORLD)) / 2 / WORLD
        torch.testing.assert_close(boundary[0], average, atol=0, rtol=0)
