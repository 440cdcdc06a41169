"""Stage-3 checkpoints: saved at 2 ranks, they resume at stage 2 on 1 rank and at stage 3 on 4
ranks exactly where the run that saved them goes on; ``zero_to_fp32``, ``save_16bit_model`` and the
consolidated state dict give the whole trained weights."""

from __future__ import annotations

import io

import pytest
import torch

from tests.distributed import run_world
from tests.runtime.models import batches, make_model

GLOBAL = 4


def _cfg(stage: int, gather: bool = True) -> dict:
    return {"train_batch_size": GLOBAL, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 150,
                                  "stage3_param_persistence_threshold": 20,
                                  "stage3_gather_16bit_weights_on_model_save": gather}}


def _bytes(obj) -> bytes:
    out = io.BytesIO()  # tensors do not survive the result queue once the rank exits: serialise
    torch.save(obj, out)
    return out.getvalue()


def _load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _steps(engine, rank: int, world: int, data) -> list[float]:
    import torch.distributed as dist

    micro, losses = GLOBAL // world, []
    for tokens, labels in data:
        loss = engine(tokens[rank * micro:(rank + 1) * micro], labels[rank * micro:(rank + 1) * micro])
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _full_params(engine) -> dict[str, torch.Tensor]:
    from dslaunch.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _save(rank: int, world: int, ckpt: str) -> bytes:
    import dslaunch

    data = batches(5, GLOBAL)
    engine, *_ = dslaunch.initialize(model=make_model(), config=_cfg(3))
    _steps(engine, rank, world, data[:3])
    engine.save_checkpoint(ckpt, tag="t")
    full = _full_params(engine)
    assert engine.save_16bit_model(ckpt, "model16.bin")
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert (consolidated is None) == (rank != 0) and consolidated != {}  # DeepSpeed's None off rank 0
    later = _steps(engine, rank, world, data[3:])
    return _bytes((full, later, consolidated or None))


def _resume(rank: int, world: int, ckpt: str, stage: int) -> bytes:
    import dslaunch

    engine, *_ = dslaunch.initialize(model=make_model(seed=9), config=_cfg(stage, gather=False))
    engine.load_checkpoint(ckpt, tag="t")
    full = _full_params(engine)
    if stage == 3:
        assert engine.save_16bit_model(ckpt, "never.bin") is False  # not gathered: nothing written
    return _bytes((full, _steps(engine, rank, world, batches(5, GLOBAL)[3:])))


@pytest.mark.timeout(120)
def test_stage3_checkpoint_resumes_at_other_world_sizes_and_stages(tmp_path) -> None:
    from dslaunch.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt = str(tmp_path)
    saved = [_load(b) for b in run_world(_save, 2, ckpt)]
    full, later, consolidated = saved[0]
    assert all(r[0].keys() == full.keys() for r in saved)
    for stage, world in ((2, 1), (3, 4)):
        for got, losses in map(_load, run_world(_resume, world, ckpt, stage)):
            for n, t in full.items():
                torch.testing.assert_close(got[n], t, rtol=0, atol=0, msg=n)
            torch.testing.assert_close(losses, later, rtol=1e-5, atol=0)
    exported = get_fp32_state_dict_from_zero_checkpoint(ckpt, tag="t")
    model16 = torch.load(tmp_path / "model16.bin", weights_only=True)
    for n, t in full.items():
        assert torch.equal(exported[n], t) and torch.equal(model16[n], t) and torch.equal(consolidated[n], t), n
    assert set(model16) == set(make_model().state_dict())
    assert not (tmp_path / "never.bin").exists()
