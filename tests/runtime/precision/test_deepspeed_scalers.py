"""``deepspeed.runtime.fp16.loss_scaler``'s classes: DeepSpeed's signatures and attribute names on
dslaunch's scaling rules, named as DeepSpeed's for ``add_safe_globals`` (the load of DeepSpeed's own
pickles is in ``tests/compat/test_safe_globals.py``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dslaunch.runtime.fp16 import loss_scaler as ds
from dslaunch.runtime.precision import loss_scaler as rules
from tests.distributed import run_world


@pytest.mark.timeout(30)
@pytest.mark.parametrize("consecutive", [False, True])
def test_the_dynamic_scaler_follows_dslaunchs_rules(consecutive: bool) -> None:
    ours = ds.DynamicLossScaler(init_scale=2.0**10, scale_window=3, min_scale=1, delayed_shift=2,
                                consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)
    ref = rules.DynamicLossScaler(init_scale=2.0**10, scale_window=3, hysteresis=2,
                                  consecutive_hysteresis=consecutive, min_scale=1, raise_error_at_min_scale=False)
    rng = random.Random(0)
    scales = set()
    for _ in range(200):
        overflow = rng.random() < 0.3
        ours.update_scale(overflow)
        ref.update(overflow)
        assert (ours.cur_scale, ours.cur_hysteresis, ours.cur_iter) == (ref.loss_scale, ref.cur_hysteresis, ref.cur_iter)
        scales.add(ours.cur_scale)
    assert len(scales) > 3  # the sequence moved the scale both ways, not a constant
    assert ours.dynamic is True and ours.delayed_shift == 2 and ours.dtype == torch.half


@pytest.mark.timeout(30)
def test_deepspeed_attributes_round_trip_through_pickling_state() -> None:
    scaler = ds.DynamicLossScaler(2.0**16, 1000, 1, 2, False)
    scaler.update_scale(True)
    state = scaler.__getstate__()
    assert state["cur_scale"] == 2.0**16 and state["cur_hysteresis"] == 1 and state["delayed_shift"] == 2
    assert "_scale" not in state and "hysteresis" not in state  # DeepSpeed's names only, as its files hold
    copy = ds.DynamicLossScaler.__new__(ds.DynamicLossScaler)
    copy.__setstate__(state)  # what an unpickler does: no __init__
    copy.update_scale(True)  # hysteresis spent: halves
    assert copy.loss_scale == 2.0**15 and copy.cur_iter == 2


@pytest.mark.timeout(30)
def test_static_scaler_scaling_and_factory() -> None:
    static = ds.LossScaler(scale=8)
    w = torch.ones(3, requires_grad=True)
    static.backward((w * 2).sum())
    assert torch.equal(w.grad, torch.full((3,), 16.0)) and not static.has_overflow([w])
    assert static.scale_gradient(None, (torch.ones(2),), ())[0].tolist() == [8.0, 8.0]
    args = {"init_scale": 2.0**8, "scale_window": 10, "min_scale": 1, "delayed_shift": 1,
            "consecutive_hysteresis": False}
    assert isinstance(ds.CreateLossScaler(torch.half, 1.0, True, args), ds.DynamicLossScaler)
    assert ds.CreateLossScaler(torch.bfloat16, 4.0, True, args).loss_scale == 1.0
    assert ds.CreateLossScaler(torch.half, 4.0, False, None).loss_scale == 4.0
    dyn = ds.CreateLossScaler(torch.half, 1.0, True, args)
    w.grad[1] = float("inf")
    assert dyn.has_overflow_serial([w]) and ds.to_python_float(torch.tensor([2.5])) == 2.5


@pytest.mark.timeout(30)
def test_classes_carry_deepspeeds_qualified_names() -> None:
    from dslaunch.runtime.zero.config import ZeroStageEnum
    from dslaunch.utils.tensor_fragment import fragment_address

    names = {f"{c.__module__}.{c.__qualname__}" for c in (ds.LossScaler, ds.DynamicLossScaler, ZeroStageEnum,
                                                          fragment_address)}
    assert names == {"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address"}


def _save_then_read(rank: int, world: int, root: str) -> tuple[dict, dict]:
    import dslaunch
    from dslaunch.runtime.checkpoint.deepspeed_read import read_deepspeed
    from dslaunch.runtime.zero.config import ZeroStageEnum
    from dslaunch.utils.tensor_fragment import fragment_address
    from tests.runtime.checkpoint import deepspeed_job

    net = deepspeed_job.model()
    engine = dslaunch.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.01),
                                 config=deepspeed_job.config(2, world, checkpoint={"format": "deepspeed"}))[0]
    engine.save_checkpoint(root, tag="t")
    plain = read_deepspeed(Path(root) / "t").loss_scaler
    # a script that allowed DeepSpeed's classes: torch then builds dslaunch's, not the reader's stand-ins
    with torch.serialization.safe_globals([ds.LossScaler, ds.DynamicLossScaler, ZeroStageEnum, fragment_address]):
        allowed = read_deepspeed(Path(root) / "t").loss_scaler
    return plain, allowed


@pytest.mark.timeout(60)
def test_reading_deepspeed_files_keeps_the_scaler_where_its_class_is_allowed(tmp_path: Path) -> None:
    plain, allowed = run_world(_save_then_read, 1, str(tmp_path))[0]
    assert plain["cur_scale"] == 1.0 and allowed == plain
